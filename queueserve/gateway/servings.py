"""``/v1/servings/{name}/dispatch``, ``/dispatch_many`` and ``/stream``: any serving, JSON in
and out, with the options every client call takes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from queueserve.door.body import JSON, NoBool, idempotency_key, parse
from queueserve.door.http_errors import ApiError, bad_request, item_error
from queueserve.errors import QueueServeError
from queueserve.gateway.core import Gateway
from queueserve.gateway.sse import EventStream, frame
from queueserve.gateway.tenants import caller
from queueserve.hooks import Event, Hook, Output, Restart
from queueserve.wire.priority import MAX_PRIORITY


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_key: StrictStr | None = None
    priority: Annotated[StrictInt, Field(ge=0, le=MAX_PRIORITY)] = 0
    timeout: Annotated[float, Field(gt=0, allow_inf_nan=False), NoBool] | None = None


class Dispatch(Options):
    item: Any


class DispatchMany(Options):
    items: Annotated[list[Any], Field(min_length=1)]
    return_exceptions: StrictBool = False


class Stream(Options):
    items: Annotated[list[Any], Field(min_length=1)]
    max_in_flight: Annotated[StrictInt, Field(ge=1, le=64)] = 4


def encoded(content: Any) -> Response:
    try:
        return JSON(content)
    except TypeError as e:
        raise ApiError(502, "unencodable_result", str(e)) from None


M = TypeVar("M", bound=Options)


async def serving_body(gw: Gateway, request: Request, model: type[M]) -> tuple[str, M]:
    """The serving a route names and the body it sent, validated into ``model``: a bad body
    is 400 before a serving no worker declared is 404 (``Gateway.submit`` and ``stream``
    require it as they send)."""
    name: str = request.path_params["name"]
    return name, await parse(request, model, gw.max_body_bytes)


def routes(gw: Gateway) -> list[Route]:
    async def dispatch(request: Request) -> Response:
        name, body = await serving_body(gw, request, Dispatch)
        key = idempotency_key(request.scope)
        (result,) = await gw.call(
            request.receive, caller(request.scope), name, [body.item], body, False, key
        )
        return encoded({"result": result})

    async def dispatch_many(request: Request) -> Response:
        name, body = await serving_body(gw, request, DispatchMany)
        key = idempotency_key(request.scope)
        results = await gw.call(
            request.receive,
            caller(request.scope),
            name,
            body.items,
            body,
            body.return_exceptions,
            key,
        )
        return encoded(
            {"results": [item_error(r) if isinstance(r, QueueServeError) else r for r in results]}
        )

    async def stream(request: Request) -> EventStream:
        name, body = await serving_body(gw, request, Stream)
        events = await gw.stream(
            caller(request.scope),
            name,
            body.items,
            body.priority,
            batch_key=body.batch_key,
            timeout=body.timeout,
            max_in_flight=body.max_in_flight,
        )
        return EventStream(serving_frames(events, body))

    path = "/v1/servings/{name}/"
    return [
        Route(path + "dispatch", dispatch, methods=["POST"]),
        Route(path + "dispatch_many", dispatch_many, methods=["POST"]),
        Route(path + "stream", stream, methods=["POST"]),
    ]


async def serving_frames(
    events: AsyncGenerator[Event, None], body: Stream
) -> AsyncGenerator[bytes, None]:
    """``hook``, ``output`` and ``restart`` events in the order the client yields them, then
    ``result``: each item's outputs, in order (what a restart voided left out)."""
    outputs: list[list[Any]] = [[] for _ in body.items]
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                yield event_frame(event, outputs)
        except (TypeError, ValueError, OverflowError) as e:  # an item the codec cannot carry
            raise bad_request(str(e)) from None
    yield frame({"outputs": outputs}, "result")


def event_frame(event: Hook | Output | Restart, outputs: list[list[Any]]) -> bytes:
    if isinstance(event, Hook):
        return frame(
            {
                "name": event.name,
                "payload": event.payload,
                "start": event.start,
                "size": event.size,
            },
            "hook",
        )
    if isinstance(event, Restart):
        for i in range(event.start, event.start + event.size):
            outputs[i] = []
        return frame({"start": event.start, "size": event.size}, "restart")
    for i, value in enumerate(event.results, event.start):
        outputs[i].append(value)
    return frame({"results": event.results, "start": event.start, "size": event.size}, "output")
