"""``create_app``: the dashboard as an ASGI app (Starlette, like the gateway: errors, bodies
and their limits are the gateway's own). Reads are open to whoever reaches the address (it
binds 127.0.0.1 by default) unless a read token is set (``--read-token``: the API's reads then
need it, or the token); every change (replay, drop, config set) needs the token. The page and
its script hold no data and are served to anyone: the page asks for the token.

Routes: ``/`` the page, ``/dashboard.js`` its script (plain files in static/, no build step),
``/api/overview`` (``?offset=N&filter=TEXT``: a page of the servings, board.py),
``/api/dead-letters/{name}``, ``/metrics`` (each serving's backlog for Prometheus, with no
worker needed: exporter.py), and the changes under ``/api/...`` as POSTs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pydantic
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from queueserve.broker.fleet import Fleet
from queueserve.dashboard.board import MAX_SERVINGS, Board, Snapshots
from queueserve.dashboard.exporter import exposition
from queueserve.door.auth import Token, refused
from queueserve.door.body import JSON, parse
from queueserve.door.crosssite import WriteRule
from queueserve.door.http_errors import HANDLERS, ApiError, error_response
from queueserve.ops.deadletter import DeadLetters
from queueserve.options.servers import DashboardOptions
from queueserve.options.stored import parse_assignments
from queueserve.settings import Settings
from queueserve.wire.keys import MAX_SERVING_NAME, Keys

ALLOW_ORIGIN = f"--allow-origin ({DashboardOptions.variable('allow_origin')})"  # what sets it

STATIC = Path(__file__).parent / "static"
MAX_BODY_BYTES = 64 * 1024


class DeadLetterAction(pydantic.BaseModel, extra="forbid"):
    serving: str = pydantic.Field(max_length=200)
    # As `queueserve dead-letter list` shows it: a stream entry id, @shard beyond shard 0
    id: str = pydantic.Field(pattern=r"^[0-9]{1,20}-[0-9]{1,20}(@[0-9]{1,4})?$")


class ConfigSet(pydantic.BaseModel, extra="forbid"):
    serving: str = pydantic.Field(max_length=200)
    assignments: list[pydantic.constr(max_length=200)] = pydantic.Field(  # type: ignore[valid-type]
        min_length=1, max_length=20
    )


def create_app(
    redis_url: str | None = None,
    *,
    prefix: str | None = None,
    token: str | None = None,
    read_token: str | None = None,
    allow_origins: Iterable[str] = (),
) -> Starlette:
    """The dashboard of the servings under ``prefix`` on ``redis_url`` (defaults:
    QUEUESERVE_REDIS_URL, QUEUESERVE_PREFIX). Without ``token`` the page is read-only; with
    ``read_token`` reading it needs that token (or ``token``)."""
    bearer = Token(token) if token is not None else None
    settings = Settings()
    fleet = Fleet(redis_url or settings.redis_url)
    views = Views(Board(fleet, prefix or settings.prefix), bearer)
    views.reader = Token(read_token) if read_token is not None else None
    views.writes = WriteRule(allow_origins, ALLOW_ORIGIN)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        fleet.close()

    return Starlette(
        routes=[
            Route("/", views.page, methods=["GET"]),
            Route("/dashboard.js", views.script, methods=["GET"]),
            Route("/api/overview", views.overview, methods=["GET"]),
            Route("/metrics", views.metrics, methods=["GET"]),
            Route("/api/dead-letters/{name}", views.dead_letters, methods=["GET"]),
            Route("/api/dead-letters/replay", views.replay, methods=["POST"]),
            Route("/api/dead-letters/drop", views.drop, methods=["POST"]),
            Route("/api/config", views.config_set, methods=["POST"]),
        ],
        lifespan=lifespan,
        exception_handlers={**HANDLERS, Exception: internal_error},
    )


class Views:
    """The routes' handlers; Redis is read in the thread pool (the admin side is sync)."""

    def __init__(self, board: Board, token: Token | None) -> None:
        self.board = board
        self.token = token
        self.reader: Token | None = None  # --read-token: reads need it (or the token)
        self.snapshots = Snapshots(board.overview)
        # One scrape's reading answers the scrapes of the next second (several Prometheus)
        self.scrapes = Snapshots(lambda _o, _f: {"text": exposition(board.fleet, board.prefix)})

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def script(self, request: Request) -> Response:
        return FileResponse(STATIC / "dashboard.js", media_type="text/javascript")

    # Changes: the token, then a page of the dashboard's own origin (or one allowed) sending
    # JSON (door/crosssite.py): another site's page cannot make a browser replay or drop.
    writes = WriteRule(setting=ALLOW_ORIGIN)

    def _may_write(self, request: Request) -> None:
        _authorize(request, self.token)
        refusal = self.writes.refusal(request.scope)
        if refusal is not None:
            raise refusal

    async def overview(self, request: Request) -> Response:
        self._may_read(request)
        offset, name_filter = overview_query(request)
        return JSON(await self.snapshots.get(offset, name_filter))

    async def metrics(self, request: Request) -> Response:
        """Each serving's backlog, live workers and dead letters (exporter.py); a read like
        the others (with --read-token, Prometheus sends it: docs/operations.md)."""
        self._may_read(request)
        text = (await self.scrapes.get(0, ""))["text"]
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def dead_letters(self, request: Request) -> Response:
        self._may_read(request)
        name = await _declared(self.board, request.path_params["name"])
        return JSON({"dead_letters": await run_in_threadpool(self.board.dead_letters, name)})

    async def replay(self, request: Request) -> Response:
        self._may_write(request)
        body = await parse(request, DeadLetterAction, MAX_BODY_BYTES)
        letters = await _letters(self.board, body.serving)
        return JSON({"replayed": body.id, "entries": await _run(letters.replay, body.id)})

    async def drop(self, request: Request) -> Response:
        self._may_write(request)
        body = await parse(request, DeadLetterAction, MAX_BODY_BYTES)
        letters = await _letters(self.board, body.serving)
        if not await _run(letters.drop, body.id):
            raise ApiError(404, "not_found", f"no dead letter {body.id} (dropped or replayed)")
        return JSON({"dropped": body.id})

    async def config_set(self, request: Request) -> Response:
        self._may_write(request)
        body = await parse(request, ConfigSet, MAX_BODY_BYTES)
        name = await _declared(self.board, body.serving)
        try:
            options = parse_assignments(body.assignments)
        except (TypeError, ValueError) as e:
            raise ApiError(400, "bad_request", str(e)) from None
        keys = Keys(self.board.prefix, name)
        fleet = self.board.fleet
        await run_in_threadpool(fleet.set_config, keys, options)
        return JSON({"serving": name, "options": await run_in_threadpool(fleet.meta, keys)})

    def _may_read(self, request: Request) -> None:
        """401 when a read token is set and the request carries neither it nor the token."""
        if self.reader is None or self.reader.allows(request.scope):
            return
        if self.token is not None and self.token.allows(request.scope):
            return
        raise refused("this dashboard needs its --read-token to be read: enter it in the page")


def overview_query(request: Request) -> tuple[int, str]:
    """``?offset=`` (how many servings to skip, by name; default 0) and ``?filter=`` (text a
    serving's name holds; default: every serving), or 400 saying what is wrong."""
    query = request.query_params
    extra = set(query) - {"offset", "filter"}
    if extra:
        raise ApiError(
            400,
            "bad_request",
            f"unknown query parameters {sorted(extra)!r:.200}: use offset, filter",
        )
    text = query.get("offset", "0")
    if not (text.isascii() and text.isdigit() and len(text) <= 9):
        raise ApiError(
            400,
            "bad_request",
            f"offset must be a whole number of servings to skip (0, {MAX_SERVINGS}, ...), "
            f"got {text!r:.50}",
        )
    name_filter = query.get("filter", "")
    if len(name_filter) > MAX_SERVING_NAME:
        raise ApiError(
            400,
            "bad_request",
            f"filter must be at most {MAX_SERVING_NAME} characters, got {len(name_filter)}",
        )
    return int(text), name_filter


def _authorize(request: Request, token: Token | None) -> None:
    if token is None:
        raise ApiError(
            403,
            "read_only",
            "this dashboard is read-only: start it with --token (or "
            f"{DashboardOptions.variable('token')}) to replay, drop or change options",
        )
    if not token.allows(request.scope):
        raise refused("enter the dashboard's --token in the page")


async def _declared(board: Board, name: str) -> str:
    """``name`` when a worker declared that serving (its meta hash holds the codec, as every
    declaration does: one HGETALL, not a scan of the prefix's servings); 404 otherwise."""
    try:
        keys = Keys(board.prefix, name) if len(name) <= MAX_SERVING_NAME else None
    except ValueError:  # a name no serving can have
        keys = None
    if keys is None or "codec" not in await run_in_threadpool(board.fleet.meta, keys):
        raise ApiError(
            404,
            "not_found",
            f"no worker has declared serving {name[:200]!r} under prefix {board.prefix!r}",
        )
    return name


async def _letters(board: Board, name: str) -> DeadLetters:
    name = await _declared(board, name)
    return await run_in_threadpool(DeadLetters, board.fleet.admin, board.prefix, name)


async def _run(call: Any, dead_id: str) -> Any:
    """A dead-letter action: 404 when there is no such record, 400 when it cannot be
    replayed (DeadLetters says why)."""
    try:
        return await run_in_threadpool(call, dead_id)
    except KeyError as e:
        raise ApiError(404, "not_found", str(e.args[0] if e.args else e)) from None
    except ValueError as e:
        raise ApiError(400, "bad_request", str(e)) from None


async def internal_error(request: Request, exc: Exception) -> Response:
    return error_response(
        ApiError(500, "internal_error", f"{type(exc).__name__} in the dashboard (see its log)")
    )
