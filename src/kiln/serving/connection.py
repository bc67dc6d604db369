"""The HTTP/1.1 connection ``kiln serve`` runs under uvicorn: uvicorn's httptools protocol
with three changes for large binary-tensor requests (a 224x224 image is 600 kB):

- the body of a request whose Content-Length is within the server's limit is held until
  it is complete, then handed to the app in one piece, not copied when it arrived in one;
  uvicorn's own protocol stops reading at every 64 kB and wakes the app for each piece
  (an event-loop round, a pause and a resume of the socket, and two copies each);
- the socket is read up to ``READ_SIZE`` bytes at a time instead of asyncio's 256 kB;
- a response's head and body leave in one ``send``: uvicorn writes them separately, and
  each write to a loopback socket wakes the client once more.

A body larger than the limit, or without a Content-Length (chunked), takes uvicorn's
path unchanged, so memory stays bounded by the limit."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

READ_SIZE = 4 << 20


class _OneSend:
    """A transport whose writes made in one turn of the event loop leave as one ``send``:
    the first is held until the next write, a close, or the loop's next turn."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport, self._loop = transport, loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._held = data
            self._loop.call_soon(self.flush)
        else:
            self._held += data
            self.flush()

    def flush(self) -> None:
        """Write what is held."""
        if self._held is not None:
            data, self._held = self._held, None
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class Connection(HttpToolsProtocol):
    """uvicorn's httptools protocol, holding whole bodies up to ``max_body`` bytes."""

    max_body = 64 << 20  # a subclass per server sets its --max-request-size

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if hasattr(transport, "max_size"):  # asyncio's socket transport reads this much
            transport.max_size = READ_SIZE
        self.transport = _OneSend(transport, self.loop)  # type: ignore[assignment]

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._hold = HIGH_WATER_LIMIT
        for name, value in self.headers:
            if name == b"content-length" and value.isdigit():
                if int(value) <= self.max_body:
                    self._hold = max(int(value), HIGH_WATER_LIMIT)
                break

    def on_body(self, body: bytes) -> None:
        if self._hold == HIGH_WATER_LIMIT:  # too large to hold, or no length: uvicorn's way
            super().on_body(body)
            return
        cycle = self.cycle
        if cycle.response_complete or (self.parser.should_upgrade() and self._should_upgrade()):
            return
        if not cycle.body and len(body) == self._hold:
            # the whole body in one piece: kept as it is, uvicorn's bytes(cycle.body) hands
            # the same object to the app, where a bytearray would be copied twice
            cycle.body = body
        else:
            cycle.body += body
        # on_message_complete wakes the app once the body is whole


def connection_class(max_body: int) -> type[Connection]:
    """A Connection holding whole bodies of up to ``max_body`` bytes."""
    return type("Connection", (Connection,), {"max_body": max_body})
