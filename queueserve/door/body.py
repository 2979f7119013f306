"""Request bodies in (size-limited, parsed and validated by pydantic) and results out as JSON.

A body is JSON as RFC 8259 writes it: ``NaN`` and ``Infinity``, which Python's parsers take, are
refused (an item sent as NaN would come back as ``null``), and so is ``true`` where a number of
seconds goes (``NoBool``). Results are whatever a serving returns, decoded by the client: numpy
arrays, torch tensors and their scalars become lists and numbers, bytes become base64 text,
NaN and infinities become ``null`` (JSON has neither).
"""

from __future__ import annotations

from typing import Any, TypeVar

import pydantic
import pydantic_core
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from queueserve.door.http_errors import ApiError, ClientGone, bad_request
from queueserve.wire.once import check_key

M = TypeVar("M", bound=pydantic.BaseModel)


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):  # JSON true is no number, though Python's bool is an int
        raise ValueError(f"{str(value).lower()} is not a number")
    return value


NoBool = pydantic.BeforeValidator(_no_bool)  # for number fields: true and false are refused


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` bytes: at once when
    Content-Length says so, else while it arrives (chunked bodies have no length)."""
    return await receive_body(request.scope, request.receive, limit)


async def receive_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """``read_body`` from the ASGI scope and channel; ClientGone if the client left first."""
    for key, value in scope["headers"]:
        if key == b"content-length" and (not value.isdigit() or int(value) > limit):
            raise too_large(limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        "body_too_large",
        f"the request body is larger than {limit} bytes (the gateway's "
        "--max-body-bytes); send fewer items per request",
    )


async def parse(request: Request, model: type[M], limit: int) -> M:
    """The body validated into ``model``; 400 saying what was wrong otherwise."""
    return validated(await read_body(request, limit), model)


def validated(body: bytes, model: type[M]) -> M:
    # pydantic's JSON reader takes NaN and Infinity where a field's type is Any (an item);
    # looked at again only when those letters are in the body at all
    if b"NaN" in body or b"Infinity" in body:
        try:
            pydantic_core.from_json(body, allow_inf_nan=False)
        except ValueError as e:
            raise bad_request(
                f"invalid {model.__name__} body: not JSON ({e}); NaN and Infinity are not "
                "JSON numbers: send null, or a string"
            ) from None
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as e:
        raise bad_request(f"invalid {model.__name__} body: {problems(e)}") from None


def problems(error: pydantic.ValidationError, most: int = 5) -> str:
    """pydantic's errors in one line, without echoing large input values back."""
    said = []
    for err in error.errors(include_input=False, include_url=False)[:most]:
        where = ".".join(map(str, err["loc"])) or "body"
        said.append(f"{where}: {err['msg']}")
    more = error.error_count() - len(said)
    return "; ".join(said) + (f" (and {more} more)" if more > 0 else "")


def plain(value: Any) -> Any:
    """``value`` as something JSON holds: arrays and tensors as lists, their scalars as
    numbers (pydantic_core calls this for types it does not know)."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"a result of type {type(value).__name__} cannot be sent as JSON")


def dumps(value: Any) -> bytes:
    return pydantic_core.to_json(value, fallback=plain, bytes_mode="base64", inf_nan_mode="null")


class JSON(Response):
    """A JSON response encoded by pydantic_core (numpy and bytes aware, fast)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


def idempotency_key(scope: Scope) -> str | None:
    """The request's ``Idempotency-Key`` header (the IETF draft's: a structured-field string,
    quoted, or the bare text), checked as ``idempotency_key=`` is; None without one; 400 for
    one that is no key."""
    for name, value in scope["headers"]:
        if name == b"idempotency-key":  # (ASGI servers lower-case header names)
            text = value.decode("latin-1")
            if len(text) > 1 and text[0] == text[-1] == '"':
                text = text[1:-1]
            try:
                return check_key(text)
            except ValueError as e:
                raise bad_request(f"Idempotency-Key header: {e}") from None
    return None
