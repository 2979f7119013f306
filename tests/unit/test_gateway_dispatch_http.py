"""``POST .../dispatch`` answered by the gateway's protocol without uvicorn's ASGI cycle
(queueserve/gateway/dispatch_http.py): every answer is the bytes uvicorn's own cycle writes for
the same request, on the same connection, and what the protocol leaves to uvicorn (a query, an
HTTP/1.0 request, Expect: 100-continue, a pipelined request) still gets its answer.

Both protocols run in-process on a fake socket; the gateway's calls are stubs (no Redis).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import pytest
import uvicorn
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
from uvicorn.server import ServerState

from queueserve.gateway import create_app, serve
from queueserve.gateway.dispatch_http import DispatchCycle, DispatchHttp
from queueserve.gateway.sse import disconnected
from queueserve.gateway.writes import OneWriteHttp
from tests.support.sockets import Socket

DATE = (b"date", b"Thu, 26 Nov 2026 21:00:00 GMT")


def post(body: bytes, path: bytes = b"/v1/servings/s/dispatch", extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer t\r\n"
        b"content-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
        % (path, extra, len(body), body)
    )


class Connection:
    """One connection of ``protocol`` to a gateway app whose calls answer at once (an item
    ``"boom"`` raises, ``"hold"`` waits for ``release``, ``"until-gone"`` returns once its
    client has gone)."""

    def __init__(self, protocol: type[OneWriteHttp]) -> None:
        app = create_app("redis://127.0.0.1:1/0", token="t", max_body_bytes=1000)
        self.gone = asyncio.Event()
        self.release = asyncio.Event()

        async def require(name: str, what: str = "serving") -> None:
            pass

        async def call(
            receive: Any, tenant: Any, serving: str, items: list[Any], *args: Any
        ) -> list[Any]:
            if items == ["boom"]:
                raise RuntimeError("a bug")
            if items == ["hold"]:
                await self.release.wait()
            if items == ["until-gone"]:
                await disconnected(receive)
                self.gone.set()
            return [{"serving": serving, "item": items[0]}]

        app.state.gateway.require, app.state.gateway.call = require, call
        # as serve.py runs it: no access log, no proxy headers
        config = Config(
            app,
            http=protocol,
            lifespan="off",
            log_level="warning",
            access_log=False,
            proxy_headers=False,
        )
        config.load()
        self.state = ServerState()
        self.state.default_headers = [DATE]
        self.protocol = protocol(config=config, server_state=self.state, app_state={})
        self.socket = Socket()
        self.protocol.connection_made(self.socket)

    async def send(self, *chunks: bytes, answers: int = 1) -> bytes:
        """What the gateway wrote once ``answers`` responses are out (or the socket closed)."""
        before = len(b"".join(self.socket.sent))
        for chunk in chunks:
            self.protocol.data_received(chunk)
        while b"".join(self.socket.sent)[before:].count(b"HTTP/1.1 ") < answers:
            if self.socket.closed:
                break
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # the turn's writes are flushed
        return b"".join(self.socket.sent)[before:]


REQUESTS = [
    post(b'{"item": 7}'),
    post(b'{"item": 7, "priority": 2, "batch_key": "k", "timeout": 5}'),
    post(b'{"item": 7}', b"/v1/servings/other%20name/dispatch"),  # escaped: uvicorn's
    post(b'{"item": 7}', b"/v1/servings/s/dispatch?x=1"),  # a query: uvicorn's
    post(b'{"item": 7}').replace(b"Bearer t", b"Bearer wrong"),  # 401
    post(b'{"items": [7]}'),  # 400
    post(b"x" * 1001),  # 413 by its Content-Length
    post(b'{"item": 7}', b"/v1/servings/a/b/dispatch"),  # no such route: 404
    post(b'{"items": [7]}', b"/v1/servings/s/dispatch_many"),  # another route
    post(b'{"item": 7}', extra=b"expect: 100-continue\r\n"),
    post(b'{"item": 7}').replace(b"HTTP/1.1", b"HTTP/1.0"),  # answered, then closed
]


async def test_each_answer_is_what_uvicorn_s_cycle_writes_on_one_kept_connection() -> None:
    lean, plain = Connection(DispatchHttp), Connection(OneWriteHttp)
    for request in REQUESTS:
        assert await lean.send(request) == await plain.send(request), request
        assert lean.socket.closed == plain.socket.closed == (request is REQUESTS[-1])
    # and the route's requests took the lean way, the others uvicorn's
    lean = Connection(DispatchHttp)
    await lean.send(post(b'{"item": 8}'))
    assert type(lean.protocol.cycle) is DispatchCycle
    await lean.send(post(b'{"item": 8}', b"/v1/servings/s/dispatch?x=1"))
    assert type(lean.protocol.cycle) is RequestResponseCycle


async def test_a_body_in_pieces_or_chunked_is_read_whole() -> None:
    lean = Connection(DispatchHttp)
    request = post(b'{"item": "pieces"}')
    answer = await lean.send(request[:20], request[20:-5], request[-5:])
    assert answer.endswith(b'{"result":{"serving":"s","item":"pieces"}}')
    chunked = (
        b"POST /v1/servings/s/dispatch HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer t\r\n"
        b"content-type: application/json\r\n"
        b'transfer-encoding: chunked\r\n\r\n4\r\n{"it\r\n9\r\nem": "c"}\r\n0\r\n\r\n'
    )
    assert (await lean.send(chunked)).endswith(b'{"result":{"serving":"s","item":"c"}}')
    body = b'{"item": "%s"}' % (b"x" * 1000)
    too_big = chunked.split(b"\r\n\r\n")[0] + b"\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    assert (await lean.send(too_big)).startswith(b"HTTP/1.1 413 ")
    assert (await lean.send(request)).startswith(b"HTTP/1.1 200 OK")  # the connection goes on


async def test_pipelined_requests_are_answered_in_order() -> None:
    lean = Connection(DispatchHttp)
    answer = await lean.send(post(b'{"item": 1}') + post(b'{"item": 2}'), answers=2)
    first, second = answer.split(b"HTTP/1.1 200 OK")[1:]
    assert first.endswith(b'"item":1}}') and second.endswith(b'"item":2}}')


async def test_connection_close_is_honoured_after_the_answer() -> None:
    lean = Connection(DispatchHttp)
    answer = await lean.send(post(b'{"item": 1}', extra=b"connection: close\r\n"))
    assert answer.startswith(b"HTTP/1.1 200 OK") and lean.socket.closed


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_an_unexpected_error_is_a_500_logged_and_the_connection_closed() -> None:
    lean, plain = Connection(DispatchHttp), Connection(OneWriteHttp)
    logged = Records()
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(logged)
    try:
        answers = [await c.send(post(b'{"item": "boom"}')) for c in (lean, plain)]
    finally:
        uvicorn_log.removeHandler(logged)
    assert answers[0] == answers[1] and answers[0].startswith(b"HTTP/1.1 500 ")
    assert lean.socket.closed and plain.socket.closed
    errors = [r.exc_info[1] for r in logged.records if r.exc_info]
    assert [str(e) for e in errors] == ["a bug", "a bug"]


async def test_a_client_gone_mid_call_is_told_to_the_call() -> None:
    lean = Connection(DispatchHttp)
    lean.protocol.data_received(post(b'{"item": "until-gone"}'))
    await asyncio.sleep(0)
    lean.protocol.connection_lost(None)
    await asyncio.wait_for(lean.gone.wait(), 30)
    await asyncio.gather(*lean.state.tasks)
    assert lean.socket.sent == []


async def test_a_call_in_flight_at_shutdown_is_answered_then_the_connection_closed() -> None:
    lean = Connection(DispatchHttp)
    lean.protocol.data_received(post(b'{"item": "hold"}'))
    await asyncio.sleep(0)
    lean.protocol.shutdown()  # what uvicorn's server does to each connection on SIGTERM
    assert not lean.socket.closed
    lean.release.set()
    await asyncio.gather(*lean.state.tasks)
    await asyncio.sleep(0)
    assert b"".join(lean.socket.sent).endswith(b'"item":"hold"}}') and lean.socket.closed


async def test_an_answered_request_is_freed_at_once_not_left_to_the_cyclic_collector() -> None:
    lean = Connection(DispatchHttp)
    gc.collect()  # what earlier tests left
    gc.disable()
    try:
        for item in range(3):  # each cycle replaces the connection's last one
            await lean.send(post(b'{"item": %d}' % item))
        alive = [o for o in gc.get_objects() if type(o) is DispatchCycle]
    finally:
        gc.enable()
    assert alive == [lean.protocol.cycle]


def test_the_gateway_s_own_http_protocol_runs_only_on_the_uvicorn_it_was_tested_with(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The release the tests run (constraints.txt) is one it was tested with
    assert serve.http_protocol() is DispatchHttp
    # Another release, whose protocol classes may differ, gets uvicorn's own, with a warning
    monkeypatch.setattr(uvicorn, "__version__", "0.99.0")
    assert serve.http_protocol() == "auto"
    assert "uvicorn 0.99.0 is not one of 0.54" in caplog.text
