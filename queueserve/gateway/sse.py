"""Server-Sent Events: an ASGI response that streams frames from an async iterator and stops
it the moment the HTTP client disconnects.

Closing the iterator is what cancels the work: the frames come from ``AsyncClient.stream``,
whose requests still queued or running are withdrawn when it is closed (docs/streaming.md,
"Leaving early cancels"). Until the first frame nothing is sent, so an error raised before it
(an unknown serving, a full queue, a bad item) is answered with its own HTTP status; after
it, an error becomes the stream's last frame.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from queueserve.door.body import dumps
from queueserve.door.http_errors import (
    ApiError,
    ClientGone,
    error_body,
    error_response,
    from_queueserve,
)
from queueserve.errors import QueueServeError

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx: pass each event on as it comes
]


def frame(data: Any, event: str | None = None) -> bytes:
    """One SSE event: ``event: NAME`` (when named) and one ``data:`` line of JSON."""
    try:
        body = dumps(data)
    except TypeError as e:  # a result JSON cannot hold: the stream ends with this error
        raise ApiError(502, "unencodable_result", str(e)) from None
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + body + b"\n\n"


def named_error(error: ApiError) -> bytes:
    return frame(error_body(error), "error")


async def disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the body was read before: only disconnect is left)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream:
    """``frames`` as an SSE response; ``error_frame`` renders an error met mid-stream."""

    def __init__(
        self,
        frames: AsyncGenerator[bytes, None],
        error_frame: Callable[[ApiError], bytes] = named_error,
    ) -> None:
        self.frames = frames
        self.error_frame = error_frame

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.get_running_loop().create_task(disconnected(receive))
        started = False
        try:
            while (data := await self._next(gone)) is not None:
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
                    started = True
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except ClientGone:
            return
        except (QueueServeError, ApiError) as e:
            error = e if isinstance(e, ApiError) else from_queueserve(e)
            if not started:
                await error_response(error)(scope, receive, send)
                return
            await send(
                {"type": "http.response.body", "body": self.error_frame(error), "more_body": True}
            )
        finally:
            gone.cancel()
            await self.frames.aclose()
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _next(self, gone: asyncio.Task[None]) -> bytes | None:
        """The next frame (None at the end); ClientGone if the client left first, having
        stopped the frames where they were (their generator then withdraws its requests)."""
        step = asyncio.get_running_loop().create_task(self._pull())
        try:
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not step.done():  # the client left, or this task is cancelled (shutdown)
                step.cancel()
                await asyncio.wait({step})  # the generator has stopped before it is closed
        if step.cancelled():
            raise ClientGone
        return step.result()

    async def _pull(self) -> bytes | None:
        return await anext(self.frames, None)
