"""A non-streamed JSON answer, rendered off the critical path when it is large.

A batch of 128 echoed members with 32-entry tables renders to tens of MB; built and encoded
in one go, it held the event loop for seconds (every other request, `/health` included,
waited). Past LARGE frame bytes the body is therefore written item by item — each choice
built from its frames, encoded and sent, then the loop runs other work before the next — as
one chunked `application/json` body with the same bytes JSONResponse would give."""
from __future__ import annotations

import asyncio
import json
from typing import Callable, Iterable

from starlette.responses import JSONResponse, Response, StreamingResponse

LARGE = 1 << 20


def _dumps(obj) -> bytes:
    # what starlette's JSONResponse.render writes
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def json_answer(head: dict, key: str, items: Iterable[Callable[[], dict]], tail: dict, headers: dict,
                size: int) -> Response:
    """`{**head, key: [item() for item in items], **tail}`, where `size` is the engine frame
    bytes it is built from; each `item` builds one entry of the list when called."""
    if size <= LARGE:
        return JSONResponse({**head, key: [item() for item in items], **tail}, headers=headers)

    async def body():
        yield _dumps(head)[:-1] + b',"' + key.encode() + b'":['
        for i, item in enumerate(items):
            await asyncio.sleep(0)  # let the loop serve others between entries
            yield (b"," if i else b"") + _dumps(item())
        yield b"]," + _dumps(tail)[1:] if tail else b"]}"

    return StreamingResponse(body(), media_type="application/json", headers=headers)
