"""One socket write per response: uvicorn's HTTP protocol with writes coalesced per loop turn.

uvicorn writes each ASGI message to the socket as it comes: a response with a body is two
writes, the status line and headers, then the body, and each is a send on the socket and, on
the other end, often a wakeup of its own. Under 64 concurrent HTTP callers the two sends were a
quarter of the gateway's CPU per request (py-spy, bench/gateway.py). Here the protocol's
transport keeps what is written during one turn of the event loop and sends it at the end of
that turn: a response's headers and body leave in one send, and a stream's events no later
than before (each ``send`` of the app ends its turn).
"""

from __future__ import annotations

import asyncio
from typing import Any

# uvicorn's httptools protocol (the C parser uvicorn[standard] installs) with the connection
# guard (connections.py); without httptools this import fails and serve.py runs uvicorn's own
from queueserve.door.connections import GuardedHttp


class TurnWrites:
    """A transport whose writes of one loop turn go out as one (everything else passes
    through to the socket's transport)."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        self._pending = []
        if not self._transport.is_closing():  # the client left: what it would have read goes
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def is_closing(self) -> bool:  # asked after every response: not through __getattr__
        return self._transport.is_closing()

    def close(self) -> None:
        self.flush()  # a response with "connection: close" is written, then the socket closed
        self._transport.close()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class OneWriteHttp(GuardedHttp):
    """uvicorn's HTTP/1.1 protocol on a ``TurnWrites`` transport (``uvicorn.run(http=...)``),
    its connections bounded by a ``ConnectionGuard`` when given one (connections.py)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(TurnWrites(transport, self.loop))  # type: ignore[arg-type]
