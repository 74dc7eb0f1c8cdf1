"""Schemas for frame payloads: small combinators, each a callable(value, path) that raises
SchemaError naming the path of the first value it refuses. Every object schema refuses
unknown keys; `bool` is never an int; strings must be text."""
from __future__ import annotations

import math
import re
from typing import Any, Callable

KiB = 1024
MiB = 1024 * KiB


class ProtocolViolation(Exception):
    """The peer broke the framing, bounds, schema or order rules. Never recoverable on the same pipe."""


class SchemaError(ProtocolViolation):
    """A payload that parsed but does not fit its kind's schema, at `path` (`SUBMIT.stop[0]`).
    A violation like any other, except for SUBMIT, whose refused field the engine names in an
    ERROR BAD_REQUEST (its framing was sound, so the pipe is still in step)."""

    def __init__(self, path: str, what: str):
        super().__init__(f"{path}: {what}")
        self.path, self.what = path, what
        self.kind: str | None = None   # set by the frame reader
        self.id: int | None = None


Schema = Callable[[Any, str], None]


def _fail(path: str, what: str) -> None:
    raise SchemaError(path, what)


def Int(lo: int = 0, hi: int = 2**63 - 1) -> Schema:
    def check(v: Any, path: str) -> None:
        if type(v) is not int or not lo <= v <= hi:
            _fail(path, f"expected int in [{lo}, {hi}]")
    return check


def Num(lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False) -> Schema:
    """A finite JSON number in [lo, hi] (or (lo, hi])."""
    bounds = "" if (lo, hi) == (-math.inf, math.inf) else f" in {'(' if lo_open else '['}{lo}, {hi}]"

    def check(v: Any, path: str) -> None:
        if type(v) not in (int, float) or (type(v) is float and not math.isfinite(v)):
            _fail(path, "expected finite number" + bounds)
        if not lo <= v <= hi or (lo_open and v == lo):
            _fail(path, "expected finite number" + bounds)
    return check


_SURROGATE = re.compile("[\ud800-\udfff]")


def Str(max_len: int = 1 * MiB, min_len: int = 0) -> Schema:
    def check(v: Any, path: str) -> None:
        if type(v) is not str or not min_len <= len(v) <= max_len:
            _fail(path, f"expected string of {min_len} to {max_len} chars" if min_len
                  else f"expected string of at most {max_len} chars")
        if _SURROGATE.search(v):  # a valid JSON escape, but not text: it could reach no client
            _fail(path, "lone UTF-16 surrogate")
    return check


def Bool() -> Schema:
    def check(v: Any, path: str) -> None:
        if type(v) is not bool:
            _fail(path, "expected bool")
    return check


_HEX_RE = re.compile(r"(?:[0-9a-f]{2})*")


def Hex(max_bytes: int = 4 * KiB) -> Schema:
    def check(v: Any, path: str) -> None:
        if type(v) is not str or len(v) > 2 * max_bytes or not _HEX_RE.fullmatch(v):
            _fail(path, "expected lower-case hex bytes")
    return check


_B64_RE = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")


def B64(max_bytes: int) -> Schema:
    """Standard base64 (RFC 4648, padded) of at most max_bytes bytes."""
    def check(v: Any, path: str) -> None:
        if type(v) is not str or len(v) > 4 * ((max_bytes + 2) // 3) or not _B64_RE.fullmatch(v):
            _fail(path, "expected base64 bytes")
    return check


def IntOrStr(as_int: Schema, as_str: Schema) -> Schema:
    """An integer checked by `as_int` or a string checked by `as_str`."""
    def check(v: Any, path: str) -> None:
        if type(v) is int:
            as_int(v, path)
        elif type(v) is str:
            as_str(v, path)
        else:
            _fail(path, "expected integer or string")
    return check


def Enum(*values: str) -> Schema:
    def check(v: Any, path: str) -> None:
        if type(v) is not str or v not in values:
            _fail(path, f"expected one of {values}")
    return check


def Null(inner: Schema) -> Schema:
    def check(v: Any, path: str) -> None:
        if v is not None:
            inner(v, path)
    return check


def List(item: Schema, max_len: int, min_len: int = 0) -> Schema:
    def check(v: Any, path: str) -> None:
        if type(v) is not list or not min_len <= len(v) <= max_len:
            _fail(path, f"expected list of {min_len}..{max_len} items")
        for i, x in enumerate(v):
            item(x, f"{path}[{i}]")
    return check


def Tuple(*items: Schema) -> Schema:
    def check(v: Any, path: str) -> None:
        if type(v) is not list or len(v) != len(items):
            _fail(path, f"expected list of exactly {len(items)} items")
        for i, (x, s) in enumerate(zip(v, items)):
            s(x, f"{path}[{i}]")
    return check


def Obj(required: dict[str, Schema], optional: dict[str, Schema] | None = None) -> Schema:
    optional = optional or {}

    def check(v: Any, path: str) -> None:
        if type(v) is not dict:
            _fail(path, "expected object")
        for k in required:
            if k not in v:
                _fail(f"{path}.{k}", "missing")
        for k, x in v.items():
            s = required.get(k) or optional.get(k)
            if s is None:
                _fail(f"{path}.{k}", "unknown key")
            s(x, f"{path}.{k}")
    return check


def OneKey(options: dict[str, Schema]) -> Schema:
    """An object holding exactly one of the named keys."""
    def check(v: Any, path: str) -> None:
        if type(v) is not dict or len(v) != 1 or next(iter(v)) not in options:
            _fail(path, f"expected an object with exactly one of {tuple(options)}")
        k, x = next(iter(v.items()))
        options[k](x, f"{path}.{k}")
    return check


_DIGITS = re.compile(r"(?:0|[1-9][0-9]{0,9})")


def IdMap(value: Schema, max_len: int) -> Schema:
    """An object from token ids (decimal strings, no leading zeros) to values."""
    def check(v: Any, path: str) -> None:
        if type(v) is not dict or len(v) > max_len:
            _fail(path, f"expected object of at most {max_len} entries")
        for k, x in v.items():
            if not _DIGITS.fullmatch(k):
                _fail(f"{path}.{k}", "expected a token id")
            value(x, f"{path}.{k}")
    return check
