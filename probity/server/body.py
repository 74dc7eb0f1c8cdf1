"""The request body: read under a size cap and a deadline, parse as strict JSON, and check
that it is text a tokenizer and the pipe can carry. Every endpoint reads its body here, so
hostile bytes are refused once, by name, before any validation or engine work."""
from __future__ import annotations

import asyncio
import re

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from ..protocol import strict_json
from .errors import APIError

DRAIN = 64 << 20  # bytes of an oversized body read (and dropped) before its 413 is sent
OFF_LOOP = 256 << 10  # bodies larger than this are parsed in a thread
MAX_DEPTH = 64  # nesting levels of arrays/objects; the deepest real body (messages[i].content[j]) has 4
# The rest of an unread body would be taken for the next request: answer and close, so
# the client sees the end at the deadline rather than when keep-alive expires.
_CLOSE = {"Connection": "close"}
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json(request: Request, cap: int, deadline: float = 30.0) -> dict:
    _check_media_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    over = declared is not None and declared.isdigit() and int(declared) > cap
    if over and int(declared) > DRAIN:  # not worth reading: answered at once
        raise APIError("request_too_large", f"request body exceeds {cap} bytes", headers=_CLOSE)
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= cap and not over:
                chunks.append(chunk)
            elif size > DRAIN:
                break
        # past the cap the rest is read and dropped (up to DRAIN bytes) before the 413: a client
        # still sending when the socket closes would get a reset, not the answer
        if over or size > cap:
            raise APIError("request_too_large", f"request body exceeds {cap} bytes", headers=_CLOSE)

    try:
        await asyncio.wait_for(read(), deadline)
    except asyncio.TimeoutError:
        if over:
            raise APIError("request_too_large", f"request body exceeds {cap} bytes", headers=_CLOSE) from None
        raise APIError("request_timeout", f"the request body did not arrive within {deadline:g}s",
                       headers=_CLOSE) from None
    raw = b"".join(chunks)
    if len(raw) > OFF_LOOP:   # parsing a few MB takes tens of ms: beside the event loop, not on it
        return await run_in_threadpool(parse, raw)
    return parse(raw)


def parse(raw: bytes) -> dict:
    """Strict JSON (no NaN/Infinity, no duplicate keys) holding a JSON object of text."""
    try:
        body = strict_json.loads(raw)
    except UnicodeDecodeError:
        raise APIError("invalid_json", "the request body is not valid UTF-8") from None
    except strict_json.TooDeep:
        raise APIError("invalid_body", f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise APIError("invalid_json", f"the request body is not valid JSON: {e}") from None
    if type(body) is not dict:
        raise APIError("invalid_body", "the request body must be a JSON object")
    check_text(body)
    return body


def check_text(body: dict) -> None:
    """Refuse lone UTF-16 surrogates (valid JSON escapes, but not text: no tokenizer, log or
    pipe can encode them) in any key or string, naming where; and bound the nesting depth.
    Iterative, so a hostile depth cannot exhaust the stack here; numbers are skipped without
    building a path, so a 64k token-id batch costs little."""
    stack: list[tuple[object, str, int]] = [(body, "", 0)]
    while stack:
        v, path, depth = stack.pop()
        if type(v) is str:
            if _SURROGATE.search(v):
                raise APIError("invalid_value", f"'{path}' holds a lone UTF-16 surrogate, which is not text", path)
            continue
        if depth >= MAX_DEPTH:
            raise APIError("invalid_body", f"the request body nests deeper than {MAX_DEPTH} levels")
        if type(v) is dict:
            for k in v:
                if _SURROGATE.search(k):
                    key = k.encode("utf-8", "backslashreplace").decode()
                    raise APIError("invalid_value", f"the key '{key}' holds a lone UTF-16 surrogate, which is not text",
                                   f"{path}.{key}" if path else key)
            children = [(x, f"{path}.{k}" if path else k) for k, x in v.items() if type(x) in _NESTED]
        else:
            children = [(x, f"{path}[{i}]") for i, x in enumerate(v) if type(x) in _NESTED]
        stack.extend((x, p, depth + 1) for x, p in reversed(children))  # the first problem in document order is named


_NESTED = (str, list, dict)


def _check_media_type(content_type: str | None) -> None:
    # No Content-Type is read as JSON (curl without -H); a declared non-JSON type is refused
    # rather than parsed as if it were JSON.
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError("unsupported_media_type",
                       f"the request body must be application/json, not {media or 'an empty type'!r}")
