"""The frame reader and schemas: hostile bytes give ProtocolViolation, never a hang or another error."""
from __future__ import annotations

import asyncio
import io
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


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(ACCEPT + TOKEN) - 1), st.integers(0, 255), st.booleans())
def test_fuzz_mutated_valid_frames(pos, byte, delete):
    data = bytearray(ACCEPT + TOKEN)
    if delete:
        del data[pos]
    else:
        data[pos] = byte
    try:
        frames = read_all_sync(bytes(data))
    except P.ProtocolViolation:
        return
    # whatever survives a mutation is still schema-valid and addressed to a request id that parsed
    for f in frames:
        P.KINDS[f.kind].schema(f.payload, f.kind)


HOSTILE_JSON = [b'"\\ud800"', b'"\\udfff x"', b"NaN", b"Infinity", b"-Infinity", b"[" * 5000 + b"]" * 5000,
                b'{"a": 1, "a": 2}', b'"\xff"', b'"\xed\xa0\x80"', b"1e999", b"-0", b"\xef\xbb\xbf0",
                b'"\\u0000"', b"{}", b"[]", b"null", b'"ok"', b"12345678901234567890123"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(k for k, v in P.KINDS.items() if v.sender == "engine")),
       st.sampled_from(["member", "message", "tokens", "choices", "members", "stop", "code", "x"]),
       st.sampled_from(HOSTILE_JSON), st.booleans())
def test_fuzz_hostile_json_in_well_framed_payloads(kind, key, value, nest):
    """Whatever JSON a frame holds, the reader either delivers a schema-valid frame whose
    strings are all text, or raises ProtocolViolation -- never another error, never a hang."""
    payload = b'{"%s": %s}' % (key.encode(), b"[" + value + b"]" if nest else value)
    for read in (read_all_sync, read_all_async):
        try:
            frames = read(framed(kind, 7, payload))
        except P.ProtocolViolation:
            continue
        for f in frames:
            P.KINDS[f.kind].schema(f.payload, f.kind)
            if not P.KINDS[f.kind].reserved:  # reserved kinds are dropped unread
                json.dumps(f.payload, ensure_ascii=False).encode("utf-8")  # every string is text


def long_entry(i: int, token_bytes: int, **more) -> dict:
    """A position with a 33-entry table, every token `token_bytes` long, and the longest
    floats repr writes."""
    h = "23" * token_bytes
    return {"id": 2**31 - 1 - i, "bytes": h, "logprob": -1.2345678901234567e-300,
            "top": [[2**31 - 1 - j, h, -1.2345678901234567e-300] for j in range(P.MAX_TOP)], **more}


@pytest.mark.parametrize("kind,count,max_items,extra,token_bytes,more", [
    ("TOKEN", 256, P.MAX_TOKEN_ENTRIES, {"member": P.MAX_MEMBERS - 1, "choice": P.MAX_CHOICES - 1}, 200,
     {"keep": 4095}),
    ("ECHO", 4096, P.ECHO_CHUNK, {"member": P.MAX_MEMBERS - 1, "start": 2**40}, 300, {}),
])
def test_entry_chunks_never_build_a_frame_beyond_its_bound(kind, count, max_items, extra, token_bytes, more):
    """256 entries of 200-byte tokens with 33 alternatives are 1.8 MB: one TOKEN frame of
    them is past its 1 MiB bound (emit() once raised inside step()). Cut by entry_chunks,
    every frame encodes, passes the reader's checks, and together they hold every entry in order."""
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
