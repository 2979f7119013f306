"""``POST /v1/servings/{name}/dispatch`` straight from the HTTP protocol, without uvicorn's
per-request ASGI machinery.

uvicorn answers each request through a ``RequestResponseCycle``: an ``asyncio.Event`` for the
body, its ``receive`` and ``send`` (which checks every header against two regexes), a wrapper
coroutine, each request's task registered and unregistered. For the gateway's busiest route,
whose own work is small, that was a tenth of the gateway's CPU per request under 64 callers
(bench/gateway.py, docs/benchmarks.md). ``DispatchHttp`` is uvicorn's httptools protocol that
hands that route, once its headers are parsed, to ``FastDispatch`` (fast.py: the token, the
body's checks, errors, disconnect-cancel, metrics) with a ``DispatchCycle`` for its ASGI
``receive`` and ``send``. Everything else goes through uvicorn as before, and so does this
route whenever it asks for what uvicorn does beyond that: ``Expect: 100-continue``, a query
string or an escaped path, a request pipelined behind one still answered, access logs,
uvicorn's own concurrency limit (the gateway bounds its connections with connections.py's
guard instead), or an app that uvicorn wrapped (then ``GatewayApp`` hands it to
``FastDispatch`` through the ASGI call, as under any server). The connection guard's
deadlines hold on both ways (``guard_headers_complete``).

``DispatchCycle`` stands in for ``RequestResponseCycle`` where uvicorn's protocol reaches into
it: ``on_body`` and ``on_message_complete`` add to ``body`` and clear ``more_body``,
``connection_lost`` sets ``disconnected``, a graceful ``shutdown`` clears ``keep_alive``, each
then calling ``message_event.set()``; a request that follows waits for ``response_complete``.
"""

from __future__ import annotations

import asyncio
import functools
from http import HTTPStatus
from typing import Any

from starlette.types import Message, Scope

from queueserve.gateway.fast import FastDispatch, serving_of
from queueserve.gateway.writes import OneWriteHttp


class DispatchCycle:
    """One ``POST .../dispatch`` request on a ``DispatchHttp`` connection."""

    __slots__ = (
        "_changed",
        "_conn",
        "_head",
        "_waiting",
        "body",
        "disconnected",
        "keep_alive",
        "more_body",
        "response_complete",
        "scope",
    )

    def __init__(self, conn: DispatchHttp, scope: Scope, keep_alive: bool) -> None:
        self._conn = conn
        self.scope = scope
        self.body = bytearray()  # arrived, not yet handed to receive
        self.more_body = True
        self.disconnected = False
        self.keep_alive = keep_alive
        self.response_complete = False
        self._changed = False  # set() since the last receive
        self._waiting: asyncio.Future[None] | None = None
        self._head: bytes | None = None

    @property
    def message_event(self) -> DispatchCycle:
        """What uvicorn's protocol calls ``.set()`` on after each change (a property: an
        attribute holding the cycle itself would make each one garbage for the cyclic
        collector to find, not freed at its end)."""
        return self

    def set(self) -> None:
        self._changed = True
        waiting = self._waiting
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    async def run(self, dispatch: FastDispatch, name: str) -> None:
        """``dispatch`` of this request. As uvicorn does with an application's, an error it
        raises is logged and the connection closed (``FastDispatch`` answered it with a 500
        first); so is a connection left without an answer (its client had gone)."""
        try:
            await dispatch(name, self.scope, self.receive, self.send)
        except Exception as exc:
            self._conn.logger.error("Exception in ASGI application\n", exc_info=exc)
            self._conn.transport.close()
        else:
            if not self.response_complete:
                self._conn.transport.close()

    async def receive(self) -> Message:
        """The ASGI ``receive`` of this request, as uvicorn's: the body as it arrives, then
        ``http.disconnect`` once the client left or the response is complete."""
        if not (self.disconnected or self.response_complete):
            self._conn.flow.resume_reading()  # on_body pauses it past 64 KiB unread
            if not self._changed:
                waiting = self._waiting
                if waiting is None or waiting.done():
                    waiting = self._waiting = self._conn.loop.create_future()
                await asyncio.shield(waiting)  # a receiver cancelled leaves it for the next
            self._changed = False
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        body, self.body = bytes(self.body), bytearray()
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: Message) -> None:
        """The ASGI ``send`` of a response with a Content-Length (``FastDispatch`` and
        Starlette's responses give one): its head and body leave in one write."""
        if self.disconnected or self.response_complete:
            return
        if message["type"] == "http.response.start":
            defaults = self._conn.server_state.default_headers
            self._head = head(message["status"], defaults, message.get("headers", ()))
            return
        if self._head is None:
            raise RuntimeError(f"{message['type']!r} sent before 'http.response.start'")
        conn = self._conn
        conn.transport.write(self._head + message.get("body", b""))
        self._head = b""
        if message.get("more_body", False):
            return
        self.response_complete = True
        self.set()  # a receive waiting for the disconnect returns
        if not self.keep_alive:
            conn.transport.close()
        conn.on_response_complete()


def head(status: int, defaults: list[tuple[bytes, bytes]], headers: Any) -> bytes:
    """The status line, uvicorn's default headers (its ``date``) and ``headers``, as uvicorn
    writes them; a response without a Content-Length is refused (this cycle never chunks)."""
    parts = [status_line(status)]
    for name, value in defaults:
        parts += (name, b": ", value, b"\r\n")
    length = False
    for name, value in headers:
        name = name.lower()
        length = length or name == b"content-length"
        parts += (name, b": ", value, b"\r\n")
    if not length:
        raise RuntimeError("DispatchCycle sends responses with a Content-Length only")
    parts.append(b"\r\n")
    return b"".join(parts)


@functools.cache
def status_line(status: int) -> bytes:
    """``HTTP/1.1 200 OK``, as uvicorn writes it."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode()


class DispatchHttp(OneWriteHttp):
    """uvicorn's HTTP/1.1 protocol (one write per response: writes.py) that answers ``POST
    .../dispatch`` through a ``DispatchCycle`` (``uvicorn.run(http=DispatchHttp)``)."""

    def on_headers_complete(self) -> None:
        dispatch = self._dispatch_of_request()
        if dispatch is None:
            super().on_headers_complete()
            return
        fast, name = dispatch
        self.guard_headers_complete()  # the body's deadline (connections.py)
        keep_alive = self.parser.should_keep_alive()
        cycle = DispatchCycle(self, self.scope, keep_alive)  # type: ignore[arg-type]
        self.cycle = cycle  # type: ignore[assignment]
        task = self.loop.create_task(cycle.run(fast, name))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def _dispatch_of_request(self) -> tuple[FastDispatch, str] | None:
        """The app's ``FastDispatch`` and the serving when this request is one it takes
        alone, with the scope filled as uvicorn fills it; None for uvicorn to answer."""
        dispatcher = getattr(self.app, "dispatcher", None)  # a GatewayApp, not wrapped
        fast: FastDispatch | None = dispatcher() if dispatcher is not None else None
        url = self.url
        previous = self.cycle
        if (
            fast is None
            or self.parser.get_method() != b"POST"
            or self.expect_100_continue
            or self.parser.should_upgrade()
            or self.parser.get_http_version() != "1.1"
            or (previous is not None and not previous.response_complete)
            or self.access_log
            or self.config.reset_contextvars  # uvicorn runs each request in a fresh context
            or self.limit_concurrency is not None
            or not url.startswith(b"/")  # absolute-form, or '*'
            or not url.isascii()
            or b"?" in url
            or b"%" in url
            or b"#" in url
        ):
            return None
        path = url.decode("ascii")
        scope = self.scope
        scope["method"] = "POST"
        scope["path"] = self.root_path + path
        scope["raw_path"] = self.root_path.encode("ascii") + url
        scope["query_string"] = b""
        name = serving_of(scope)  # type: ignore[arg-type]
        return None if name is None else (fast, name)
