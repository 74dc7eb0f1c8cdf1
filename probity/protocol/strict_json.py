"""Strict JSON, the one reader for everything probity parses from a peer: HTTP request bodies
(server/body.py) and pipe frames (frames.py), in both directions.

Strict means: UTF-8 only, no `NaN`/`Infinity` (not JSON, and they would reach a client as
numbers it cannot read), no duplicate keys (which value counts would be the parser's guess),
and a nesting too deep for the parser is an error of its own kind, not a crash."""
from __future__ import annotations

import json
from typing import Any


class TooDeep(ValueError):
    """The document nests deeper than the parser can follow."""


def loads(raw: bytes | str) -> Any:
    """Parse `raw` strictly. Raises UnicodeDecodeError (bytes that are not UTF-8), TooDeep, or
    ValueError (anything else that is not strict JSON), each with a message fit for a client."""
    text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
    try:
        return json.loads(text, parse_constant=_no_constants, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise TooDeep("the document nests too deeply") from None


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON; floats in their shortest round-trip form, and a non-finite float is
    the caller's bug (it raises)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode()


def _no_constants(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k.encode('utf-8', 'backslashreplace').decode()!r}")
        out[k] = v
    return out
