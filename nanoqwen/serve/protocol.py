"""The HTTP/1.1 connection: uvicorn's h11 protocol with the limits a server open to a network needs and
uvicorn does not have. A request must arrive whole (head and body) within ``read_timeout`` seconds of the
connection or of its first byte, so half-sent requests cannot hold connections and file descriptors
(slowloris); a head still incomplete at ``MAX_HEAD_BYTES`` is refused by h11 as it arrives (a complete one
is no larger than one socket read, and the app's Guard then checks its size and header count); an idle kept-alive connection closes after ``KEEP_ALIVE_S`` (limits.py); and h11's own
refusals (a malformed or oversized head) are OpenAI error objects rather than uvicorn's plain text."""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError
from .limits import KEEP_ALIVE_S, MAX_HEAD_BYTES, READ_TIMEOUT_S

_READING = (h11.IDLE, h11.SEND_BODY)   # the client's side while a request is not yet whole


def uvicorn_options(read_timeout: float = READ_TIMEOUT_S) -> dict:
    """uvicorn.Config's keywords for these limits."""
    return {"http": protocol(read_timeout), "timeout_keep_alive": KEEP_ALIVE_S,
            "h11_max_incomplete_event_size": MAX_HEAD_BYTES}


def protocol(read_timeout: float) -> type:
    class Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state in _READING:
                self._arm()
            elif self._deadline is not None:   # the request is whole: the app's time is not limited here
                self._deadline.cancel()
                self._deadline = None

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None:   # counted from the request's first byte, not renewed by each byte
                self._deadline = self.loop.call_later(read_timeout, self._expire)

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state in _READING and not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            err = APIError(f"{msg.rstrip('.')}: a malformed request, or a request line and headers over "
                           f"{MAX_HEAD_BYTES} bytes", code="invalid_http_request")
            body = json.dumps(err.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return Protocol
