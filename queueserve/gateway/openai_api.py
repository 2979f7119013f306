"""The OpenAI-compatible endpoints: ``POST /v1/embeddings``, ``POST /v1/completions``
(``stream`` true or false) and ``GET /v1/models``, for the official clients pointed at the
gateway with ``base_url``.

A request's ``model`` names a serving: through the app's ``models`` mapping (DEFAULT_MODELS,
plus ``--model ALIAS=SERVING``), else the serving of that name. Embeddings send the texts as
items and take each item's result as its vector. Completions send each prompt as an item
``{"prompt", "max_new", "temperature", "seed", "stop"}`` (tasks/charlm.py's form) to a step or
generator serving whose steps are text pieces; a choice's text is its steps joined. The
gateway counts no tokens: ``usage`` (embeddings, and completions not streamed) holds zeros.

What each answer must hold is OpenAI's published schema, copied in
tests/contracts/openai_schema.json and checked by tests/integration/test_openai_contract.py.
"""

from __future__ import annotations

import base64
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictStr
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from queueserve.door.body import JSON, NoBool, parse
from queueserve.door.http_errors import ApiError, bad_request, error_body
from queueserve.gateway.core import Gateway
from queueserve.gateway.servings import Options, encoded
from queueserve.gateway.sse import EventStream, frame
from queueserve.gateway.tenants import caller
from queueserve.hooks import Event, Output, Restart

# OpenAI model names of the servings in tasks/: a client written for OpenAI's embedding
# models keeps its model name and reaches the MiniLM serving.
DEFAULT_MODELS = {
    "all-MiniLM-L6-v2": "embed",
    "sentence-transformers/all-MiniLM-L6-v2": "embed",
}
DONE = b"data: [DONE]\n\n"
# OpenAI's schema requires usage in an embeddings answer and allows it in a completion (its
# API always sends it there); the gateway counts no tokens.
NO_USAGE = {"prompt_tokens": 0, "total_tokens": 0}
NO_COMPLETION_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


class OpenAIBody(BaseModel):
    # OpenAI clients send fields this gateway has no use for ("user", ...): ignored.
    model_config = ConfigDict(extra="ignore")

    model: Annotated[StrictStr, Field(min_length=1)]


class Embeddings(OpenAIBody):
    input: StrictStr | Annotated[list[StrictStr], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


# OpenAI's own bounds: max_tokens and seed are 32- and 64-bit integers. The same check holds
# with and without ``stream`` (a larger one could not be sent to a worker: it failed the
# stream after its 200, as a 500 with a traceback).
MAX_TOKENS = 2**31 - 1
SEED_BOUND = 2**63
# Below this a temperature samples as greedy decoding does, and dividing logits by it
# overflows (1e-300 made the sampler raise): it is taken as 0, greedy (docs/gateway.md).
GREEDY_BELOW = 1e-3


class Completions(OpenAIBody):
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS), NoBool] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False), NoBool] | None = None
    seed: Annotated[int, Field(ge=-SEED_BOUND, lt=SEED_BOUND), NoBool] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=1)] | None = None
    stream: bool = False
    n: Literal[1] = 1
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None

    def sampling_temperature(self) -> float:
        if self.temperature is None:
            return 1.0
        return 0.0 if self.temperature < GREEDY_BELOW else self.temperature

    def items(self) -> list[dict[str, Any]]:
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        stop = self.stop[0] if isinstance(self.stop, list) and self.stop else self.stop
        return [
            {
                "prompt": p,
                "max_new": 16 if self.max_tokens is None else self.max_tokens,
                "temperature": self.sampling_temperature(),
                "seed": self.seed or 0,
                "stop": stop or None,
            }
            for p in prompts
        ]


def routes(gw: Gateway) -> list[Route]:
    async def models(request: Request) -> Response:
        names = await gw.servings()
        aliases = [alias for alias, serving in gw.models.items() if serving in names]
        return JSON(
            {
                "object": "list",
                "data": [
                    {"id": n, "object": "model", "created": 0, "owned_by": "queueserve"}
                    for n in [*names, *aliases]
                ],
            }
        )

    async def embeddings(request: Request) -> Response:
        body = await parse(request, Embeddings, gw.max_body_bytes)
        if body.dimensions is not None:
            raise bad_request(
                "dimensions is not supported: leave it out (a serving's vectors "
                "have the width its model makes)"
            )
        serving = gw.models.get(body.model, body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        vectors = await gw.call(
            request.receive, caller(request.scope), serving, texts, Options(), model=body.model
        )
        return encoded(
            {
                "object": "list",
                "model": body.model,
                "data": [
                    {
                        "object": "embedding",
                        "index": i,
                        "embedding": vector_as(v, body.encoding_format),
                    }
                    for i, v in enumerate(vectors)
                ],
                "usage": NO_USAGE,
            }
        )

    async def completions(request: Request) -> Response | EventStream:
        body = await parse(request, Completions, gw.max_body_bytes)
        serving = gw.models.get(body.model, body.model)
        items = body.items()
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
        }
        if body.stream:
            events = await gw.stream(
                caller(request.scope), serving, items, model=body.model, max_in_flight=len(items)
            )
            return EventStream(completion_frames(events, items, head), openai_error)
        answers = await gw.call(
            request.receive, caller(request.scope), serving, items, Options(), model=body.model
        )
        texts = ["".join(map(str, a)) for a in answers]
        return encoded(
            {
                **head,
                "choices": [choice(i, t, finish(items[i], t)) for i, t in enumerate(texts)],
                "usage": NO_COMPLETION_USAGE,
            }
        )

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]


def vector_as(vector: Any, encoding: str) -> Any:
    """One embedding as a list of floats, or as base64 of little-endian float32 (what the
    OpenAI clients ask for to save bandwidth)."""
    try:
        array = np.asarray(vector, dtype="<f4")
    except (TypeError, ValueError) as e:
        raise ApiError(
            502, "unencodable_result", f"the serving's result is not a vector of numbers: {e}"
        ) from None
    if array.ndim != 1:
        raise ApiError(
            502,
            "unencodable_result",
            f"the serving's result has shape {array.shape}, not a vector's",
        )
    if encoding == "base64":
        return base64.b64encode(array.tobytes()).decode()
    return array.tolist()


def choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}


def finish(item: dict[str, Any], text: str) -> str:
    stop = item["stop"]
    return "stop" if stop and text.endswith(stop) else "length"


def openai_error(error: ApiError) -> bytes:
    """An error mid-stream, as the OpenAI clients read one: a data event holding ``error``;
    then ``[DONE]``, which ends every stream (a client reading to it is not left waiting)."""
    return frame(error_body(error)) + DONE


async def completion_frames(
    events: AsyncGenerator[Event, None], items: list[dict[str, Any]], head: dict[str, Any]
) -> AsyncGenerator[bytes, None]:
    """A chunk per step of the prompts (one choice per prompt that produced text), then a
    chunk per prompt with its finish reason, then ``[DONE]``."""
    texts = [""] * len(items)
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Restart):
                raise ApiError(
                    502,
                    "restarted",
                    "the worker generating this completion died and another runs it "
                    "again from the start: what was streamed is void; ask again",
                )
            if isinstance(event, Output):
                pieces = [str(r) for r in event.results]
                for i, piece in enumerate(pieces, event.start):
                    texts[i] += piece
                yield frame(
                    {
                        **head,
                        "choices": [choice(i, p, None) for i, p in enumerate(pieces, event.start)],
                    }
                )
    yield frame(
        {**head, "choices": [choice(i, "", finish(items[i], t)) for i, t in enumerate(texts)]}
    )
    yield DONE
