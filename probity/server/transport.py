"""HTTP/1.1 connection handling: uvicorn's h11 protocol with a request-header deadline.

uvicorn bounds idle keep-alive connections but not a client that trickles its request
headers; such a client could hold a connection forever. Here a connection that has not
delivered a complete request head within `HEADER_TIMEOUT` seconds of connecting (or of its
previous response) is closed. Request bodies have their own deadline in the app."""
from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT = 10.0


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
