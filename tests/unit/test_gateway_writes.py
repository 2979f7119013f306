"""The gateway's HTTP protocol writes a response in one send (queueserve/gateway/writes.py):
uvicorn's own writes the status line and headers, then the body, each at once."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.config import Config
from uvicorn.server import ServerState

from queueserve.gateway.writes import OneWriteHttp, TurnWrites
from tests.support.sockets import Socket


async def turn() -> None:
    await asyncio.sleep(0)


async def test_writes_of_one_turn_leave_in_one_send_at_its_end() -> None:
    socket = Socket()
    transport = TurnWrites(socket, asyncio.get_running_loop())
    transport.write(b"head ")
    transport.write(b"body")
    assert socket.sent == []
    await turn()
    assert socket.sent == [b"head body"]
    transport.write(b"next")
    await turn()
    assert socket.sent == [b"head body", b"next"]
    assert transport.get_extra_info("peername") == ("127.0.0.1", 5555)  # the rest passes through


async def test_close_sends_what_is_pending_first_and_abort_drops_it() -> None:
    socket = Socket()
    transport = TurnWrites(socket, asyncio.get_running_loop())
    transport.write(b"last words")
    transport.close()
    assert socket.sent == [b"last words"] and socket.closed
    await turn()  # the turn's flush finds nothing left
    assert socket.sent == [b"last words"]

    socket = Socket()
    transport = TurnWrites(socket, asyncio.get_running_loop())
    transport.write(b"never")
    transport.abort()
    await turn()
    assert socket.sent == [] and socket.closed


async def test_what_is_pending_when_the_client_left_is_not_written() -> None:
    socket = Socket()
    transport = TurnWrites(socket, asyncio.get_running_loop())
    transport.write(b"too late")
    socket.closed = True  # the connection was lost within the turn
    await turn()
    assert socket.sent == []


async def test_a_response_with_a_body_is_one_send_through_uvicorns_protocol() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        headers = [(b"content-length", b"13")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"result":17}'})

    config = Config(app, http=OneWriteHttp, lifespan="off", log_level="warning")
    config.load()
    state = ServerState()
    protocol = OneWriteHttp(config=config, server_state=state, app_state={})
    socket = Socket()
    protocol.connection_made(socket)
    protocol.data_received(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}")
    await asyncio.gather(*state.tasks)
    await turn()
    assert len(socket.sent) == 1
    head, body = socket.sent[0].split(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and body == b'{"result":17}'
    protocol.connection_lost(None)
