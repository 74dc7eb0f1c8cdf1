"""The frame reader and schemas: hostile bytes give ProtocolViolation, never a hang or another error."""
from __future__ import annotations

import asyncio
import copy
import io
import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from probity import protocol as P

TOKEN = P.encode("TOKEN", 7, {"member": 0, "choice": 0, "tokens": [
    {"id": 5, "bytes": "e282", "logprob": -1.25, "top": [[5, "e282", -1.25], [9, "41", -2.5]]}]})
ACCEPT = P.encode("ACCEPT", 7, {"members": [{"prompt_tokens": 3, "cached_tokens": 0}]})


def read_all_sync(data: bytes, sender: str = "engine") -> list[P.Frame]:
    r = P.SyncReader(io.BufferedReader(io.BytesIO(data)), sender)
    out = []
    while (f := r.read()) is not None:
        out.append(f)
    return out


def read_all_async(data: bytes, sender: str = "engine") -> list[P.Frame]:
    async def go():
        s = asyncio.StreamReader(limit=1 << 16)
        s.feed_data(data)
        s.feed_eof()
        r = P.AsyncReader(s, sender)
        out = []
        while (f := await r.read()) is not None:
            out.append(f)
        return out
    return asyncio.run(asyncio.wait_for(go(), 5))


@pytest.mark.parametrize("read", [read_all_sync, read_all_async])
def test_valid_frames_round_trip(read):
    frames = read(ACCEPT + TOKEN)
    assert [f.kind for f in frames] == ["ACCEPT", "TOKEN"] and frames[1].payload["tokens"][0]["logprob"] == -1.25


def test_floats_round_trip_exactly():
    v = -0.1234567890123456789
    f = read_all_sync(P.encode("TOKEN", 1, {"member": 0, "choice": 0, "tokens": [{"id": 1, "bytes": "", "logprob": v}]}))
    assert f[0].payload["tokens"][0]["logprob"] == v


def test_non_finite_floats_cannot_be_encoded():
    with pytest.raises(ValueError):
        P.encode("TOKEN", 1, {"member": 0, "choice": 0, "tokens": [{"id": 1, "bytes": "", "logprob": float("-inf")}]})


def framed(kind: str, rid: int, payload: bytes) -> bytes:
    return b"%s %d %d\n%s\n" % (kind.encode(), rid, len(payload), payload)


HOSTILE = {
    "header_too_long": b"TOKEN 7 " + b"1" * 80 + b"\n",
    "bad_header": b"token 7 2\n{}\n",
    "unknown_kind": b"BOGUS 7 2\n{}\n",
    "server_kind_from_engine": b"SUBMIT 7 2\n{}\n",
    "leading_zero_id": b"DONE 07 2\n{}\n",
    "oversize_length": b"ACCEPT 7 999999999\n",
    "short_payload": b"DONE 7 10\n{}\n",
    "missing_terminator": b"DONE 7 2\n{}X",
    "bad_json": b"DONE 7 2\n{]\n",
    "not_an_object": b"DONE 7 2\n[]\n",
    "unknown_key": b'DONE 7 9\n{"x": 1}\n',
    "wrong_type": b'ACCEPT 7 15\n{"members": 1}\n',
    "nan": b'TOKEN 7 79\n{"member":0,"choice":0,"tokens":[{"id":1,"bytes":"","logprob":NaN,"top":null}]}\n',
    "uppercase_hex": b'TOKEN 7 63\n{"member":0,"choice":0,"tokens":[{"id":1,"bytes":"AB","logprob":1}]}\n',
    "eof_in_header": b"DONE 7",
    "no_lf_within_bound": b"D" * 70000,
    # well framed, hostile JSON inside
    "lone_surrogate": framed("ERROR", 7, b'{"code": "INTERNAL", "message": "a\\ud800b"}'),
    "lone_surrogate_in_stop": framed("DONE", 7, b'{"choices": [{"member": 0, "choice": 0, "finish_reason": "stop", '
                                                b'"stop": "\\udc00", "completion_tokens": 1}]}'),
    "deep_nesting": framed("DONE", 7, b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "duplicate_key": framed("ACCEPT", 7, b'{"members": [], "members": [{"prompt_tokens": 1, "cached_tokens": 0}]}'),
    "bom": framed("DONE", 7, b"\xef\xbb\xbf{}"),
    "invalid_utf8": framed("ERROR", 7, b'{"code": "INTERNAL", "message": "\xff\xfe"}'),
    "encoded_surrogate": framed("ERROR", 7, b'{"code": "INTERNAL", "message": "\xed\xa0\x80"}'),
    "infinity": framed("TOKEN", 7, b'{"member":0,"choice":0,"tokens":[{"id":1,"bytes":"","logprob":-Infinity}]}'),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.parametrize("read", [read_all_sync, read_all_async])
def test_hostile_bytes_are_protocol_violations(read, name):
    with pytest.raises(P.ProtocolViolation):
        read(HOSTILE[name])


def test_reserved_group_kinds_are_bounded_and_terminated():
    assert read_all_sync(b'GRPP 7 2\n{}\n')[0].kind == "GRPP"
    with pytest.raises(P.ProtocolViolation):
        read_all_sync(b"GRPE 7 2\n{}X")
    with pytest.raises(P.ProtocolViolation):
        read_all_sync(b"GRPS 7 %d\n" % (P.KINDS["GRPS"].max_payload + 1))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_fuzz_random_bytes_only_ever_raise_protocol_violation(data):
    for read in (read_all_sync, read_all_async):
        try:
            read(data)
        except P.ProtocolViolation:
            pass


HOSTILE_JSON = [b'"\\ud800"', b'"\\udfff x"', b"NaN", b"Infinity", b"-Infinity", b"[" * 5000 + b"]" * 5000,
                b'{"a": 1, "a": 2}', b'"\xff"', b'"\xed\xa0\x80"', b"1e999", b"-0", b"\xef\xbb\xbf0",
                b'"\\u0000"', b"{}", b"[]", b"null", b'"ok"', b"12345678901234567890123"]


# ---------------------------------------------------------------- mutations with a known verdict
# Every verdict below is written down from docs/protocol.md (framing in section 1, the kinds'
# fields in section 2); none asks the reader or P.KINDS[...].schema what they think.

ACCEPT_P = {"members": [{"prompt_tokens": 3, "cached_tokens": 0}]}
TOKEN_P = {"member": 0, "choice": 0, "tokens": [
    {"id": 5, "bytes": "e282", "logprob": -1.25, "top": [[5, "e282", -1.25], [9, "41", -2.5]]}]}
FRAMES = [P.encode("ACCEPT", 7, ACCEPT_P), P.encode("TOKEN", 7, TOKEN_P)]
STREAM = b"".join(FRAMES)
WHOLE = [("ACCEPT", 7, ACCEPT_P), ("TOKEN", 7, TOKEN_P)]
ENGINE_KINDS = {"READY", "ACCEPT", "ECHO", "TOKEN", "DONE", "ERROR", "STATS", "GRPP", "GRPG", "GRPS", "GRPE"}
RESERVED = {"GRPP", "GRPG", "GRPS", "GRPE"}


def verdicts(streams: list[bytes]) -> list:
    """Each stream read to its end by both readers: [(kind, id, payload), ...], or None where
    it raised ProtocolViolation (any other exception fails the test). The readers must agree."""
    def sync(data):
        try:
            return [(f.kind, f.id, f.payload) for f in read_all_sync(data)]
        except P.ProtocolViolation:
            return None

    async def one(data):
        s = asyncio.StreamReader(limit=1 << 16)
        s.feed_data(data)
        s.feed_eof()
        r, out = P.AsyncReader(s, "engine"), []
        try:
            while (f := await r.read()) is not None:
                out.append((f.kind, f.id, f.payload))
        except P.ProtocolViolation:
            return None
        return out

    async def every():
        return [await one(d) for d in streams]

    got = [sync(d) for d in streams]
    for d, a, b in zip(streams, got, asyncio.run(asyncio.wait_for(every(), 60))):
        assert a == b, (d[:80], a, b)
    return got


def test_untouched_frames_are_delivered_as_encoded():
    assert verdicts([STREAM]) == [WHOLE]


def test_a_stream_cut_anywhere_but_at_a_frame_boundary_is_a_violation():
    complete = {0: [], len(FRAMES[0]): WHOLE[:1], len(STREAM): WHOLE}
    got = verdicts([STREAM[:n] for n in range(len(STREAM) + 1)])
    wrong = [(n, v) for n, v in enumerate(got) if v != complete.get(n)]
    assert not wrong, wrong[:5]


def test_deleting_any_one_byte_is_a_violation():
    """A deletion in a header breaks its grammar or changes its length; in a payload it makes
    the frame one byte short of its length, so its terminator is not where the length says."""
    got = verdicts([STREAM[:i] + STREAM[i + 1:] for i in range(len(STREAM))])
    assert [i for i, v in enumerate(got) if v is not None] == []


def test_changing_a_header_or_terminator_byte_is_a_violation_unless_it_only_renames_the_id():
    """Every byte of both headers, their LFs and both terminators, set to each of the 255 other
    values: a kind no longer a kind, a broken grammar, a length that no longer ends at the
    terminator (a longer one reads into the next frame or hits EOF, a shorter one ends inside the
    payload) or a missing terminator are all violations; a digit for a digit in the id is a
    valid frame for another id."""
    for name in ("ACCEPT", "TOKEN"):  # no one-byte change turns either kind into another engine kind
        for i in range(len(name)):
            for c in range(256):
                other = name[:i] + chr(c) + name[i + 1:]
                assert other == name or other not in ENGINE_KINDS
    cases, want, at = [], [], 0
    for j, fb in enumerate(FRAMES):
        lf, id_at = fb.index(b"\n"), fb.index(b" ") + 1
        assert fb[id_at:id_at + 2] == b"7 "
        for p in [*range(lf + 1), len(fb) - 1]:
            for b in range(256):
                if b == fb[p]:
                    continue
                data = bytearray(STREAM)
                data[at + p] = b
                cases.append(bytes(data))
                if p == id_at and 0x30 <= b <= 0x39:
                    w = list(WHOLE)
                    w[j] = (w[j][0], b - 0x30, w[j][2])
                    want.append(w)
                else:
                    want.append(None)
        at += len(fb)
    got = verdicts(cases)
    wrong = [(c, g) for c, g, w in zip(cases, got, want) if g != w]
    assert not wrong, wrong[:5]


DELETE = object()
NOT_INT = ["0", 1.5, True, None, [], {}]
# per field: (path, valid replacements, invalid replacements, required); paths into the payloads
ACCEPT_FIELDS = [
    (("members",), [[{"prompt_tokens": 0, "cached_tokens": 0}] * P.MAX_MEMBERS],
     [[], [{"prompt_tokens": 0, "cached_tokens": 0}] * (P.MAX_MEMBERS + 1), {}, None, "x", [None], [[]]], True),
    (("members", 0, "prompt_tokens"), [0, 2**40], NOT_INT + [-1], True),
    (("members", 0, "cached_tokens"), [0, 3], NOT_INT + [-1], True),
]
TOKEN_FIELDS = [
    (("member",), [P.MAX_MEMBERS - 1], NOT_INT + [-1, P.MAX_MEMBERS], True),
    (("choice",), [P.MAX_CHOICES - 1], NOT_INT + [-1, P.MAX_CHOICES], True),
    (("tokens",), [[{"id": 1, "bytes": "41", "logprob": -1.0}] * P.MAX_TOKEN_ENTRIES],
     [[], [{"id": 1, "bytes": "41", "logprob": -1.0}] * (P.MAX_TOKEN_ENTRIES + 1), {}, None, [None]], True),
    (("tokens", 0, "id"), [0, 2**31 - 1], NOT_INT + [-1, 2**31], True),
    (("tokens", 0, "bytes"), ["", "00ff"], ["E2", "e", "zz", 12, None, ["e2"]], True),
    (("tokens", 0, "logprob"), [None, 0, -1e300], ["-1", True, [], {}], True),
    (("tokens", 0, "top"), [None, [], [[1, "41", -1.0]] * P.MAX_TOP],
     ["x", {}, [[1, "41", -1.0]] * (P.MAX_TOP + 1), [[5, "e282"]], [[5, "e282", -1.25, 0]], [None]], False),
    (("tokens", 0, "top", 0, 0), [0], ["5", True, -1, 2**31, None], True),
    (("tokens", 0, "top", 0, 1), ["", "41"], ["E2", "e", 41, None], True),
    (("tokens", 0, "top", 0, 2), [None, -3], ["x", True, []], True),
    (("tokens", 0, "keep"), [0, 4096], [-1, 4097, True, 1.5, None, "1"], False),   # absent: added
    (("tokens", 0, "eos"), [True, False], [1, 0, "true", None], False),            # absent: added
]
OBJECTS = {"ACCEPT": [(), ("members", 0)], "TOKEN": [(), ("tokens", 0)]}


def mutated(payload: dict, path: tuple, value) -> dict:
    p = copy.deepcopy(payload)
    node = p
    for k in path[:-1]:
        node = node[k]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return p


def schema_cases():
    """(kind, payload, accepted?) from the field tables: every value swapped for valid and
    invalid ones, every key removed, an unknown key added to every object."""
    for kind, base, fields in (("ACCEPT", ACCEPT_P, ACCEPT_FIELDS), ("TOKEN", TOKEN_P, TOKEN_FIELDS)):
        for path, good, bad, required in fields:
            for v in good:
                yield kind, mutated(base, path, v), True
            for v in bad:
                yield kind, mutated(base, path, v), False
            if type(path[-1]) is str:
                try:
                    yield kind, mutated(base, path, DELETE), not required
                except KeyError:
                    pass  # an optional key the base payload does not hold
        for path in OBJECTS[kind]:
            yield kind, mutated(base, path + ("zz",), 1), False


def test_each_field_is_checked_as_documented():
    cases = list(schema_cases())
    got = verdicts([framed(k, 7, json.dumps(p).encode()) for k, p, _ in cases])
    wrong = [(k, p, ok) for (k, p, ok), g in zip(cases, got) if g != ([(k, 7, p)] if ok else None)]
    assert not wrong, wrong[:5]


NOT_STRICT = {b"NaN", b"Infinity", b"-Infinity", b"[" * 5000 + b"]" * 5000, b'{"a": 1, "a": 2}', b'"\xff"',
              b'"\xed\xa0\x80"', b"\xef\xbb\xbf0"}


def test_hostile_json_in_well_framed_payloads_gets_the_documented_verdict():
    """{key: value} and {key: [value]} in every engine kind. JSON that is not strict (NaN and
    Infinity, a duplicate key, nesting beyond the parser, bytes that are not UTF-8, a BOM) is a
    violation in any kind. A reserved GRP* kind takes any strict JSON object. Of the other
    kinds only DONE {"choices": []} fits: every other kind requires keys a one-key payload
    lacks, or the key is none of its fields, or its value has another type."""
    keys = ["member", "message", "tokens", "choices", "members", "stop", "code", "x"]
    cases, want = [], []
    for kind, key, value, nest in itertools.product(sorted(ENGINE_KINDS), keys, HOSTILE_JSON, (False, True)):
        payload = b'{"%s": %s}' % (key.encode(), b"[" + value + b"]" if nest else value)
        cases.append(framed(kind, 7, payload))
        if value in NOT_STRICT:
            ok = False
        elif kind in RESERVED:
            ok = True
        else:
            ok = (kind, key, value, nest) == ("DONE", "choices", b"[]", False)
        want.append([(kind, 7, json.loads(payload))] if ok else None)
    assert sum(w is not None for w in want) == 4 * 8 * 10 * 2 + 1  # the accepted cases are not rare
    got = verdicts(cases)
    wrong = [(c[:60], g) for c, g, w in zip(cases, got, want) if g != w]
    assert not wrong, wrong[:5]


def long_entry(i: int, token_bytes: int, **more) -> dict:
    """A position with a 33-entry table, every token `token_bytes` long, and the longest
    floats repr writes."""
    h = "23" * token_bytes
    return {"id": 2**31 - 1 - i, "bytes": h, "logprob": -1.2345678901234567e-300,
            "top": [[2**31 - 1 - j, h, -1.2345678901234567e-300] for j in range(P.MAX_TOP)], **more}


# a position's row reports at their widest: 256 scores of the longest repr, a 30,000-character row
ROWS = {"scores": [-1.2345678901234567e-300] * P.MAX_SCORE_TOKENS, "dist": "A" * 30000}


@pytest.mark.parametrize("kind,count,max_items,extra,token_bytes,more", [
    ("TOKEN", 256, P.MAX_TOKEN_ENTRIES, {"member": P.MAX_MEMBERS - 1, "choice": P.MAX_CHOICES - 1}, 200,
     {"keep": 4095, **ROWS}),
    ("ECHO", 1024, P.ECHO_CHUNK, {"member": P.MAX_MEMBERS - 1, "start": 2**40}, 300, ROWS),
])
def test_entry_chunks_never_build_a_frame_beyond_its_bound(kind, count, max_items, extra, token_bytes, more):
    """256 entries of 200-byte tokens with 33 alternatives, 256 scores and a distribution row
    are 12.6 MB: one TOKEN frame of them is past its 8 MiB bound (emit() once raised inside
    step()). Cut by entry_chunks, every frame encodes, passes the reader's checks, and together
    they hold every entry in order."""
    entries = [long_entry(i, token_bytes, **more) for i in range(count)]
    key = "tokens" if kind == "TOKEN" else "positions"
    with pytest.raises(ValueError):
        P.encode(kind, 1, {**extra, key: entries[:max_items]})
    chunks = P.entry_chunks(kind, entries, max_items)
    assert len(chunks) > count // max_items
    seen = []
    for start, part in chunks:
        assert start == len(seen) and 1 <= len(part) <= max_items
        frame = P.encode(kind, 1, {**extra, key: part})
        seen += read_all_sync(frame)[0].payload[key]
    assert seen == entries
    small = [{"id": 1, "bytes": "41", "logprob": -1.0} for _ in range(600)]
    assert [len(p) for _, p in P.entry_chunks(kind, small, max_items)] == \
        [max_items] * (600 // max_items) + ([600 % max_items] if 600 % max_items else [])


def test_a_held_writer_sends_a_steps_frames_in_one_write_in_order_whatever_ends_the_step():
    """The engine writes one step's frames at the step's end (pipe.Writer.held): nothing is on
    the pipe before, every frame is there after, in the order sent, byte for byte as one
    write each would give -- also when the step raises; another thread's frame is not held."""
    import os
    import threading

    from probity.engine.pipe import Writer

    r, w = os.pipe()
    try:
        out = Writer(w)
        frames = [P.encode("TOKEN", i, {"member": 0, "choice": 0, "tokens": [{"id": i, "logprob": -0.5}]})
                  for i in range(1, 4)]
        os.set_blocking(r, False)
        with pytest.raises(RuntimeError):
            with out.held():
                for f in frames[:2]:
                    out.send_encoded(f)
                with pytest.raises(BlockingIOError):
                    os.read(r, 1 << 16)                    # held: nothing written yet
                other = threading.Thread(target=out.send_encoded, args=(frames[2],))
                other.start()
                other.join()
                assert os.read(r, 1 << 16) == frames[2]    # another thread's frame goes out at once
                raise RuntimeError("the step failed")
        assert os.read(r, 1 << 16) == frames[0] + frames[1]
        assert out.holder is None
    finally:
        os.close(r)
        os.close(w)
