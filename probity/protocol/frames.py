"""Frames: their kinds, bounds and schemas, encoding, and checked reading. docs/protocol.md is
the prose version and must match this file."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from . import strict_json
from .schema import (B64, Bool, Enum, Hex, Int, KiB, List, MiB, Null, Num, Obj, ProtocolViolation, Schema, SchemaError,
                     Str, Tuple, _fail)
from .submit import MAX_CHOICES, MAX_LOGPROBS, MAX_MEMBERS, MAX_SCORE_TOKENS, MAX_STOP_CHARS, SUBMIT_SCHEMA, TOKEN_ID

PROTOCOL_VERSION = 1
MAX_HEADER = 64  # bytes, LF excluded
_HEADER_RE = re.compile(rb"([A-Z]{1,10}) (0|[1-9][0-9]{0,19}) ([0-9]{1,9})")


class FrameTooLarge(ValueError):
    """A payload that encodes beyond its kind's bound: the sender refuses it before writing."""


# ---------------------------------------------------------------- frame kinds

MAX_TOP = MAX_LOGPROBS + 1
MAX_RESULT_IDS = 1 << 21  # ids in one tokenize result
MAX_ECHO_POSITIONS = 4096
ECHO_CHUNK = 256          # positions an engine sends per ECHO frame (fewer when they are large)
MAX_TOKEN_ENTRIES = 256
MAX_DIST_VOCAB = 1 << 20  # a distribution row (float32, base64) of a larger vocabulary would not fit a frame
ID = Int(0, 2**64 - 1)
LOGPROB = Null(Num())
TOP = List(Tuple(TOKEN_ID, Hex(), LOGPROB), MAX_TOP)

ERROR_CODES = (
    "BAD_REQUEST",        # a field of the SUBMIT payload is invalid
    "CONTEXT_EXCEEDED",   # prompt + max_tokens beyond the context window
    "PROMPT_BUDGET",      # the members' prompt tokens together exceed max_prompt_tokens
    "CANCELLED",          # answered a CANCEL
    "OVERLOADED",         # the engine has no room for it
    "TOO_LARGE",          # its answer would not fit the frame bounds (a tokenize of > MAX_RESULT_IDS ids)
    "INTERNAL",           # the engine failed while running it
    "PROTOCOL",           # id 0 only: the engine could not read the server's frames; it exits
)

# what a position reports beyond its value and table, when SUBMIT asked: its whole log-softmax
# row (float32, little-endian, base64) and the values of SUBMIT's score_tokens, in their order
_ROW = {"dist": B64(4 * MAX_DIST_VOCAB), "scores": List(LOGPROB, MAX_SCORE_TOKENS, 1)}
_position = Obj(
    {"id": TOKEN_ID, "bytes": Hex(), "logprob": LOGPROB},
    {"top": Null(TOP), "template": Bool(), **_ROW},  # template: a chat prompt's token that its template wrote
)
_token = Obj(
    {"id": TOKEN_ID, "bytes": Hex(), "logprob": LOGPROB},
    {"top": Null(TOP), "keep": Int(0, 4 * KiB), "eos": Bool(), **_ROW},
)
_usage = Obj({"prompt_tokens": Int(), "completion_tokens": Int(), "cached_tokens": Int()})
_finished = Obj({
    "member": Int(0, MAX_MEMBERS - 1),
    "choice": Int(0, MAX_CHOICES - 1),
    "finish_reason": Enum("stop", "length", "grammar_dead_end"),
    "stop": Null(Str(MAX_STOP_CHARS)),
    "completion_tokens": Int(),
})


@dataclass(frozen=True)
class Kind:
    name: str
    sender: str          # "server" or "engine"
    max_payload: int     # bytes
    schema: Schema
    reserved: bool = False  # drained and dropped by the reader's consumer


KINDS: dict[str, Kind] = {}


def _kind(name: str, sender: str, max_payload: int, schema: Schema, reserved: bool = False) -> None:
    KINDS[name] = Kind(name, sender, max_payload, schema, reserved)


# server -> engine
_kind("SUBMIT", "server", 16 * MiB, SUBMIT_SCHEMA)
_kind("CANCEL", "server", 64, Obj({}))
_kind("SHUTDOWN", "server", 64, Obj({}))
# engine -> server
_kind("READY", "engine", 1 * MiB, Obj({
    "protocol": Int(),
    "model": Obj({
        "id": Str(256), "context_length": Int(1), "vocab_size": Int(1),
        "eos_token_ids": List(TOKEN_ID, 64), "bos_token": Null(Str(256)), "eos_token": Null(Str(256)),
        "pad_token": Null(Str(256)),
        "dtype": Str(32), "fingerprint": Str(256), "chat_template": Null(Str(256 * KiB)),
        "source": Str(4096),
    }),
    "capabilities": Obj({
        "logprobs": Bool(), "max_logprobs": Int(0, 1024), "echo": Bool(), "token_ids": Bool(),
        "seed": Bool(), "chat_template": Bool(), "max_members": Int(1), "max_choices": Int(1),
    }, {
        # what the numbers promise: bit-identical whatever else runs (batch_invariant) and
        # whether or not a prefix came from the cache (prefix_cache)
        "batch_invariant": Bool(), "prefix_cache": Bool(),
        # constrained decoding (SUBMIT's grammar), and how the chat template writes tool calls
        "grammar": Bool(), "tool_format": Enum("hermes", "llama3_json", "mistral"),
        "tools_in_template": Bool(),
        # SUBMIT's distribution and score_tokens, and the most distribution floats one request may ask for
        "distribution": Bool(), "score_tokens": Bool(), "max_distribution_floats": Int(),
    }),
    "concurrency": Int(1, 4096),
}, {
    # bytes the engine holds, by part (what each part is: docs/engine.md, Memory)
    "memory": Obj({}, {k: Int() for k in ("weights_kernels", "weights_stored", "weights_other",
                                          "kv_pool", "hidden_pool", "echo_cache", "kept_keys_max", "resident",
                                          "grammar_cache_max")}),
}))
_kind("ACCEPT", "engine", 64 * KiB, Obj({
    "members": List(Obj({"prompt_tokens": Int(), "cached_tokens": Int()}), MAX_MEMBERS, 1),
}, {
    "score_ids": List(TOKEN_ID, MAX_SCORE_TOKENS, 1),  # SUBMIT's score_tokens as ids, in their order
}))
_kind("ECHO", "engine", 8 * MiB, Obj({
    "member": Int(0, MAX_MEMBERS - 1), "start": Int(), "positions": List(_position, MAX_ECHO_POSITIONS, 1),
}))
_kind("TOKEN", "engine", 8 * MiB, Obj({
    "member": Int(0, MAX_MEMBERS - 1), "choice": Int(0, MAX_CHOICES - 1),
    "tokens": List(_token, MAX_TOKEN_ENTRIES, 1),
}))
_kind("DONE", "engine", 16 * MiB, Obj({}, {
    "choices": List(_finished, MAX_MEMBERS * MAX_CHOICES),
    "usage": _usage,
    "timings": Obj({}, {k: Num() for k in ("queue_s", "prefill_s", "decode_s")}),
    "result": Obj({}, {
        "ids": List(TOKEN_ID, MAX_RESULT_IDS), "text": Str(16 * MiB), "count": Int(),
    }),
}))
_kind("ERROR", "engine", 64 * KiB, Obj(
    {"code": Enum(*ERROR_CODES), "message": Str(16 * KiB)},
    {"member": Int(0, MAX_MEMBERS - 1), "param": Str(256)},
))
_kind("STATS", "engine", 64 * KiB, Obj({}, {
    "active": Int(), "waiting": Int(), "tokens_per_s": Num(), "steps": Int(),
    # cumulative since the engine started
    "forward_passes": Int(), "prompt_tokens_computed": Int(), "generated_tokens": Int(),
    "prefix_query_tokens": Int(), "prefix_hit_tokens": Int(), "preemptions": Int(),
    # now
    "kv_blocks_used": Int(), "kv_blocks_total": Int(),
    "resident_bytes": Int(), "grammar_cache_bytes": Int(), "grammar_cache_entries": Int(),
}))
for _name in ("GRPP", "GRPG", "GRPS", "GRPE"):
    _kind(_name, "engine", 1 * MiB, lambda v, p: None if type(v) is dict else _fail(p, "expected object"),
          reserved=True)


@dataclass(frozen=True)
class Frame:
    kind: str
    id: int
    payload: dict
    size: int = 0  # payload bytes as read (what a response assembled from it costs, roughly)


# ---------------------------------------------------------------- encoding

def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def encode(kind: str, rid: int, payload: dict) -> bytes:
    """Encode one frame. Floats go out with repr precision (round-trips exactly);
    a non-finite float here is a bug in the caller and raises."""
    if kind not in KINDS:
        raise ValueError(f"unknown frame kind {kind}")
    body = strict_json.dumps(payload)
    if len(body) > KINDS[kind].max_payload:
        raise FrameTooLarge(f"{kind} payload of {len(body)} bytes exceeds its bound of {KINDS[kind].max_payload}")
    return b"%s %d %d\n%s\n" % (kind.encode(), rid, len(body), body)


def entry_size_bound(e: dict) -> int:
    """An upper bound on the encoded size of one ECHO position or TOKEN entry: ids of at most
    10 digits, floats of at most 24 characters, hex and base64 as given (a cheap sum, no encoding)."""
    top = e.get("top") or ()
    return (128 + len(e["bytes"]) + sum(48 + len(t[1]) for t in top) + len(e.get("dist", ""))
            + 32 * len(e.get("scores", ())))


def entry_chunks(kind: str, entries: list[dict], max_items: int) -> list[tuple[int, list[dict]]]:
    """`entries` cut into (offset, slice) pieces that each fit one `kind` frame: at most
    max_items entries and, with 1 KiB left for the frame's other fields, its payload bound.
    A model with long tokens and wide tables fills a frame by size before it fills it by count."""
    budget = KINDS[kind].max_payload - KiB
    out: list[tuple[int, list[dict]]] = []
    start, size = 0, 0
    for i, e in enumerate(entries):
        n = entry_size_bound(e)
        if i > start and (i - start >= max_items or size + n > budget):
            out.append((start, entries[start:i]))
            start, size = i, 0
        size += n
    if start < len(entries):
        out.append((start, entries[start:]))
    return out


# ---------------------------------------------------------------- decoding

def parse_header(line: bytes, expect_sender: str) -> tuple[Kind, int, int]:
    """Check a header line (without its LF): shape, kind, id, and the kind's length bound."""
    if len(line) > MAX_HEADER:
        raise ProtocolViolation(f"header longer than {MAX_HEADER} bytes")
    m = _HEADER_RE.fullmatch(line)
    if not m:
        raise ProtocolViolation(f"malformed header {line[:MAX_HEADER]!r}")
    name, rid, length = m.group(1).decode(), int(m.group(2)), int(m.group(3))
    kind = KINDS.get(name)
    if kind is None or kind.sender != expect_sender:
        raise ProtocolViolation(f"unexpected frame kind {name}")
    if rid >= 2**64:
        raise ProtocolViolation("id out of range")
    if length > kind.max_payload:
        raise ProtocolViolation(f"{name} length {length} exceeds bound {kind.max_payload}")
    return kind, rid, length


def parse_payload(kind: Kind, rid: int, data: bytes) -> Frame:
    """Check payload + terminator (data holds length+1 bytes) and the kind's schema."""
    if data[-1:] != b"\n":
        raise ProtocolViolation(f"{kind.name} frame not terminated by LF")
    try:
        obj = strict_json.loads(data[:-1])
    except strict_json.TooDeep:
        raise ProtocolViolation(f"{kind.name} payload nests too deeply") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise ProtocolViolation(f"{kind.name} payload is not JSON: {e}") from None
    if type(obj) is not dict:
        raise ProtocolViolation(f"{kind.name} payload is not an object")
    try:
        kind.schema(obj, kind.name)
    except SchemaError as e:
        e.kind, e.id = kind.name, rid
        raise
    return Frame(kind.name, rid, obj, len(data) - 1)


class SyncReader:
    """Blocking frame reader over a binary file (the engine's stdin)."""

    def __init__(self, stream, expect_sender: str):
        self._s = stream
        self._sender = expect_sender

    def read(self) -> Frame | None:
        """The next frame, or None on a clean EOF at a frame boundary."""
        line = self._s.readline(MAX_HEADER + 1)
        if not line:
            return None
        if not line.endswith(b"\n"):
            raise ProtocolViolation("header not terminated within bound")
        kind, rid, length = parse_header(line[:-1], self._sender)
        data = self._s.read(length + 1)
        if len(data) != length + 1:
            raise ProtocolViolation("EOF inside a frame")
        return parse_payload(kind, rid, data)


class AsyncReader:
    """Frame reader over an asyncio.StreamReader (the server's view of engine stdout).

    Once a header has arrived, the rest of the frame must follow within `frame_timeout`
    seconds: a peer that stalls inside a frame is a violation, not a reason to hang."""

    def __init__(self, stream, expect_sender: str, frame_timeout: float = 10.0):
        self._s = stream
        self._sender = expect_sender
        self._frame_timeout = frame_timeout

    async def read(self) -> Frame | None:
        import asyncio

        try:
            line = await self._s.readuntil(b"\n")
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                return None
            raise ProtocolViolation("EOF inside a header") from None
        except asyncio.LimitOverrunError:
            raise ProtocolViolation("header not terminated within bound") from None
        kind, rid, length = parse_header(line[:-1], self._sender)
        try:
            data = await asyncio.wait_for(self._s.readexactly(length + 1), self._frame_timeout)
        except asyncio.IncompleteReadError:
            raise ProtocolViolation("EOF inside a frame") from None
        except asyncio.TimeoutError:
            raise ProtocolViolation(f"{kind.name} frame not completed within {self._frame_timeout:g}s") from None
        return parse_payload(kind, rid, data)
