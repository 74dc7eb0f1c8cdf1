"""HTTP/1.1 connection handling: uvicorn's h11 protocol with a request-header deadline and
named refusals of malformed HTTP.

uvicorn bounds idle keep-alive connections but not a client that trickles its request
headers; such a client could hold a connection forever. Here a connection that has not
delivered a complete request head within `HEADER_TIMEOUT` seconds of connecting (or of its
previous response) is closed. Request bodies have their own deadline in the app.

A request h11 cannot parse (a malformed Content-Length, two Host headers, a request line or
header block past h11's 16 KiB bound) got uvicorn's plain-text 400, and a large header block
a connection reset: the socket was closed with the client's bytes unread, so the kernel sent
RST before the client read the answer. Here it gets the error envelope like every other
refusal (`invalid_http_request` 400, or `request_header_too_large` 431), then the write side
is shut and what the client still sends is read and dropped for up to `LINGER` seconds, so
the answer arrives."""
from __future__ import annotations

import json
import uuid

from uvicorn.protocols.http import h11_impl
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError

HEADER_TIMEOUT = 10.0
LINGER = 2.0


class DeadlineH11Protocol(H11Protocol):
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if getattr(self, "_lingering", False):
            return  # refused already: drain, so the close that follows is not a reset
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        pending, _ = self.conn.trailing_data
        too_long = len(pending) > self.conn._max_incomplete_event_size
        err = (APIError("request_header_too_large", "the request line and headers exceed 16 KiB")
               if too_long else APIError("invalid_http_request", "malformed HTTP/1.1 request (request line, "
                                         "headers or framing): it could not be parsed"))
        body = json.dumps(err.openai_body()).encode()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"x-request-id: %s\r\nconnection: close\r\n\r\n" % (err.status, b"Request Header Fields Too Large" if too_long
                                                   else b"Bad Request", len(body), f"req_{uuid.uuid4().hex}".encode()))
        self.logger.warning("refused a malformed HTTP request: %s", err.code)
        self.transport.write(head + body)
        self._lingering = True
        self._disarm()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER, self.transport.close)

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(HEADER_TIMEOUT, self._expire)

    def _disarm(self) -> None:
        handle = getattr(self, "_head_deadline", None)
        if handle is not None:
            handle.cancel()
            self._head_deadline = None

    def _expire(self) -> None:
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        if waiting_for_head and not self.transport.is_closing():
            self.transport.close()


async def connection_limit_reached(scope, receive, send) -> None:
    """What uvicorn runs instead of the app past --max-connections: the error envelope (its own
    answer is a plain-text 503), in the Anthropic shape on /v1/messages."""
    err = APIError("too_many_connections", "the server has --max-connections connections open; retry shortly",
                   headers={"Retry-After": "1"})
    body = err.anthropic_body() if scope.get("path", "").startswith("/v1/messages") else err.openai_body()
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": err.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
        (b"retry-after", b"1"), (b"x-request-id", f"req_{uuid.uuid4().hex}".encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


# uvicorn looks the function up in its h11 module at each refusal; this is the one place it is named.
h11_impl.service_unavailable = connection_limit_reached
