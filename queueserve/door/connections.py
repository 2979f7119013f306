"""The connections ``queueserve gateway`` and ``queueserve dashboard`` hold: deadlines on what a
client sends, and how many connections it may hold (issue 38, finding 1).

uvicorn arms no timer before its first response, so a connection that never finishes its request
head was held forever: 3,000 half-sent heads held for 30 s were never closed, and at about
20,000 the gateway ran out of file descriptors and every request failed. ``GuardedHttp`` is
uvicorn's httptools protocol with a ``ConnectionGuard``:

- **deadlines**: a request head must arrive whole within ``header_timeout`` of the connection
  (or of its first byte, after a kept-alive response), its body within ``body_timeout`` of the
  head, and a kept-alive connection may stay silent ``keep_alive_timeout`` between requests;
  past a deadline the connection is closed (a head begun and not finished gets a 408 first).
  The server's own time (a request being answered, a stream) has no deadline here.
- **counts**: at most ``max_connections`` open at once; one more takes the place of the
  connection waiting longest on its client (a head or body not finished, or idle between
  requests), or is closed at once when every connection is being answered. One client address
  may hold at most ``max_connections_per_client`` (0: no cap); past it its new connections are
  closed at once, before anything is read, and other addresses are not affected. Behind a
  proxy every connection comes from the proxy's address (docs/gateway.md says how to set it).

Cost per request: a few attribute writes and two dict operations, no timer call. Each connection
has at most one ``loop.call_at`` handle, armed no later than its deadline and no further ahead
than the shortest timeout (``tick``), so a deadline set later is never earlier than the armed
handle: the handle, when it fires, closes the connection or arms itself again, and a connection
answered and answered again meanwhile arms nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from queueserve.options.servers import DashboardOptions, GatewayOptions, ServerOptions

log = logging.getLogger(__name__)

# What a connection waits for (GuardedHttp._phase).
CONNECTED, HEAD, BODY, WORKING, IDLE = range(5)
SAY_EVERY_S = 60.0  # one warning line a minute at most, with the counts since the last
TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 46\r\nconnection: close\r\n\r\n"
    b"the request head did not arrive within its time"
)
FD_RESERVE = 64  # descriptors kept for Redis, logs and the listening socket


# GuardedHttp (here) and the gateway's writes.py and dispatch_http.py build on uvicorn's HTTP
# protocol classes, which are not its public API: the releases they were tested with
# (constraints.txt pins the one the tests run).
TESTED_UVICORN = ("0.54",)


@dataclass(frozen=True)
class Limits:
    """What a server's connections may do: its options of these names (``limits_of``; their
    defaults are each server's, in queueserve/options/servers.py)."""

    header_timeout: float
    body_timeout: float
    keep_alive_timeout: float
    max_connections: int
    max_connections_per_client: int

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < math.inf):
                raise ValueError(f"{name} must be a duration > 0, like 10s, got {value!r}")
        if not (isinstance(self.max_connections, int) and self.max_connections >= 1):
            raise ValueError(f"max_connections must be an int >= 1, got {self.max_connections!r}")
        per = self.max_connections_per_client
        if not (isinstance(per, int) and per >= 0):
            raise ValueError(f"max_connections_per_client must be an int >= 0, got {per!r}")

    @property
    def tick(self) -> float:
        return min(self.header_timeout, self.body_timeout, self.keep_alive_timeout)


def limits_of(options: ServerOptions) -> Limits:
    """The connection options of a server's options (queueserve/options/servers.py)."""
    return Limits(**{f.name: getattr(options, f.name) for f in fields(Limits)})


def fitted(limits: Limits, what: str) -> Limits:
    """``limits`` with ``max_connections`` lowered to what this process's descriptor limit
    (``ulimit -n``) leaves, saying so: past it every accept fails, every client's alike."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = soft - FD_RESERVE if soft != resource.RLIM_INFINITY else limits.max_connections
    if limits.max_connections <= room:
        return limits
    room = max(room, 1)
    log.warning(
        "%s: --max-connections %d lowered to %d: this process may open %d files "
        "(ulimit -n); raise that limit to hold more",
        what,
        limits.max_connections,
        room,
        soft,
    )
    return replace(limits, max_connections=room)


class ConnectionGuard:
    """One server's connections: how many each client address holds, and those waiting on
    their client, oldest first (the ones a new connection may take the place of)."""

    def __init__(self, limits: Limits, what: str = "gateway") -> None:
        self.limits = limits
        self.what = what
        self.tick = limits.tick
        self.open = 0
        self.per_client: dict[str, int] = {}
        self.waiting: OrderedDict[GuardedHttp, None] = OrderedDict()
        self.counts = {"refused": 0, "evicted": 0, "timed out": 0}
        self._unsaid: dict[str, int] = {}
        self._said_at = -math.inf

    def admit(self, conn: GuardedHttp, client: str) -> bool:
        """Counts ``conn`` in, or False: its address holds its cap, or every connection is
        being answered (closing it is the caller's)."""
        held = self.per_client.get(client, 0)
        cap = self.limits.max_connections_per_client
        if cap and held >= cap:
            self.note("refused", f"{client} holds --max-connections-per-client {cap}")
            return False
        if self.open >= self.limits.max_connections:
            if not self.waiting:
                self.note("refused", f"--max-connections {self.limits.max_connections} reached")
                return False
            victim, _ = self.waiting.popitem(last=False)
            self.release(victim)
            victim.transport.close()
            self.note("evicted", "waiting longest on its client, for a new connection")
        self.per_client[client] = held + 1
        self.open += 1
        self.waiting[conn] = None
        conn._client_key = client
        return True

    def release(self, conn: GuardedHttp) -> None:
        client = conn._client_key
        if client is None:
            return
        conn._client_key = None
        self.open -= 1
        held = self.per_client[client] - 1
        if held:
            self.per_client[client] = held
        else:
            del self.per_client[client]
        self.waiting.pop(conn, None)
        if conn._timer is not None:
            conn._timer.cancel()
            conn._timer = None

    def note(self, kind: str, why: str) -> None:
        """Counts a connection closed by the guard; one warning a minute at most says how
        many, and why the last was."""
        self.counts[kind] += 1
        self._unsaid[kind] = self._unsaid.get(kind, 0) + 1
        now = asyncio.get_running_loop().time()
        if now - self._said_at >= SAY_EVERY_S:
            self._said_at = now
            said = ", ".join(f"{n} {k}" for k, n in self._unsaid.items())
            self._unsaid = {}
            log.warning(
                "%s: connections closed by the guard since the last line: %s (the last: %s); "
                "%d open",
                self.what,
                said,
                why,
                self.open,
            )


class GuardedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol whose connections a ``ConnectionGuard`` bounds
    (``uvicorn.run(http=functools.partial(GuardedHttp, guard=guard))``); without a guard,
    uvicorn's own."""

    def __init__(self, *args: Any, guard: ConnectionGuard | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self._client_key: str | None = None  # set while the guard counts it
        self._phase = CONNECTED
        self._deadline = math.inf
        self._timer: asyncio.TimerHandle | None = None

    # --- the connection's deadline --------------------------------------------------------
    def _wait(self, phase: int, seconds: float) -> None:
        self._phase = phase
        now = self.loop.time()
        self._deadline = now + seconds
        if self._timer is None:
            self._arm(now)

    def _arm(self, now: float) -> None:
        assert self.guard is not None
        at = min(self._deadline, now + self.guard.tick)
        self._timer = self.loop.call_at(at, self._expire)

    def _expire(self) -> None:
        self._timer = None
        guard = self.guard
        if guard is None or self._client_key is None or self._deadline == math.inf:
            return  # released, or being answered: the next wait arms again
        now = self.loop.time()
        if now < self._deadline:
            self._arm(now)
            return
        if self._phase == HEAD:
            self.transport.write(TIMEOUT_408)
        guard.release(self)
        guard.note("timed out", f"{PHASES[self._phase]} past its deadline")
        self.transport.close()

    # --- uvicorn's protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        guard = self.guard
        if guard is None:
            return
        client = self.client[0] if self.client else ""
        if not guard.admit(self, client):
            self.transport.abort()
            return
        self._wait(CONNECTED, guard.limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.guard is not None:
            self.guard.release(self)
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.guard is not None and self._phase == IDLE:
            self._wait(HEAD, self.guard.limits.header_timeout)
        elif self._phase == CONNECTED:
            self._phase = HEAD  # the first head keeps its deadline from the connection

    def guard_headers_complete(self) -> None:
        """The head arrived: the body's deadline (DispatchHttp calls this for the requests
        it answers without ``on_headers_complete``)."""
        if self.guard is not None and self._phase <= HEAD:
            self._wait(BODY, self.guard.limits.body_timeout)

    def on_headers_complete(self) -> None:
        self.guard_headers_complete()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        guard = self.guard
        if guard is None or self._phase != BODY:
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            self._phase = WORKING  # the server's turn: no deadline, not to be evicted
            self._deadline = math.inf
            guard.waiting.pop(self, None)

    def on_response_complete(self) -> None:
        """uvicorn's, with the guard's keep-alive deadline in place of a timer per response."""
        guard = self.guard
        if guard is None:
            super().on_response_complete()
            return
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        self.flow.resume_reading()
        if self.pipeline:  # a request that came behind this one: answered next
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        if self._client_key is not None:
            self._wait(IDLE, guard.limits.keep_alive_timeout)
            guard.waiting[self] = None
            guard.waiting.move_to_end(self)


PHASES = {
    CONNECTED: "a connection silent",
    HEAD: "a request head",
    BODY: "a request body",
    WORKING: "a request answered",
    IDLE: "a kept-alive connection idle",
}


def guarded(protocol: type[GuardedHttp], guard: ConnectionGuard) -> Any:
    """``protocol`` bound to ``guard``, for ``uvicorn.run(http=...)``."""

    def make(*args: Any, **kwargs: Any) -> GuardedHttp:
        return protocol(*args, guard=guard, **kwargs)

    return make


def describe(limits: Limits) -> str:
    per = limits.max_connections_per_client or "no cap"
    return (
        f"head {limits.header_timeout:g}s, body {limits.body_timeout:g}s, keep-alive "
        f"{limits.keep_alive_timeout:g}s, at most {limits.max_connections} connections, "
        f"{per} per client address"
    )


def run(
    app: Any, options: GatewayOptions | DashboardOptions, limits: Limits, http: Any, **more: Any
) -> None:
    """``uvicorn.run`` as both servers run it, until SIGTERM: ``options``' address and log
    level, no access log, the app's lifespan, uvicorn's keep-alive timer at ``limits``' (it
    runs only where uvicorn's own protocol does, without the guard), ``http`` the protocol
    (``guarded``'s, else "auto"); ``more``: a server's own settings."""
    # uvicorn logs the address it bound (with --port 0, the port it was given) at INFO.
    uvicorn.run(
        app,
        host=options.host,
        port=options.port,
        log_level=options.log_level.lower(),
        access_log=False,
        lifespan="on",
        timeout_keep_alive=max(1, round(limits.keep_alive_timeout)),
        http=http,
        **more,
    )


__all__: Sequence[str] = (
    "ConnectionGuard",
    "GuardedHttp",
    "Limits",
    "describe",
    "fitted",
    "guarded",
    "limits_of",
    "run",
)
