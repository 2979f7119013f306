"""The load shapes of ``python -m bench.embed_peers``, the same for every system, and the check
of every vector they get back.

A system is reached through a :class:`Door`: one text (``one``) or many texts in requests of
a given size (``chunks``). :class:`HttpDoor` is the one load generator of every HTTP server
(OpenAI's ``POST /v1/embeddings``, keep-alive connections of bench/gateway.py's
:class:`RawHttp`); :class:`ClientDoor` is queueserve's own ``AsyncClient`` (``dispatch``, and
``map(chunk_size=32)``). Every vector that comes back is compared with sentence-transformers'
own vector of the same text (:class:`Checker`): a missing or extra vector fails the run, and the
lowest cosine is kept so the report can withhold the figures of a system below 0.999.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

import numpy as np

from ._harness import percentile
from ._verdict import WorkFailed
from .gateway import RawHttp

GRACE_S = 120.0  # beyond a phase's own length: the backlog of a saturated system drains


class Checker:
    """Reference vectors (sentence-transformers direct) of every text; ``check`` compares
    answers with them and keeps the lowest cosine seen."""

    def __init__(self, reference: np.ndarray) -> None:
        norms = np.linalg.norm(reference, axis=1, keepdims=True)
        self.unit = reference / np.maximum(norms, 1e-12)
        self.min_cos = 1.0
        self.vectors = 0

    def reset(self) -> None:
        self.min_cos, self.vectors = 1.0, 0

    def check(self, what: str, indices: Sequence[int], vectors: Any) -> None:
        got = np.asarray(vectors, dtype=np.float64)
        if got.ndim != 2 or got.shape != (len(indices), self.unit.shape[1]):
            raise WorkFailed(
                f"{what}: {len(indices)} texts sent, answer of shape {got.shape} "
                f"(want ({len(indices)}, {self.unit.shape[1]}))"
            )
        norms = np.linalg.norm(got, axis=1)
        cos = np.einsum("ij,ij->i", got, self.unit[list(indices)]) / np.maximum(norms, 1e-12)
        low = float(np.min(cos)) if np.all(np.isfinite(cos)) else math.nan
        if not math.isnan(self.min_cos):  # NaN stays: it withholds the system's figures
            self.min_cos = low if math.isnan(low) else min(low, self.min_cos)
        self.vectors += len(indices)


class Door(Protocol):
    name: str

    async def one(self, text: int) -> Any: ...

    async def chunks(self, texts: Sequence[int], size: int, in_flight: int) -> Any: ...

    async def close(self) -> None: ...


class Conn(RawHttp):
    """RawHttp that reconnects after the server closed an idle connection."""

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        super().connection_lost(exc)


class HttpDoor:
    """OpenAI's ``POST /v1/embeddings`` on 127.0.0.1:``port``: one request per call, each on a
    keep-alive connection of its own while it runs (a pool that grows as calls overlap)."""

    def __init__(self, name: str, port: int, texts: Sequence[str], model: str) -> None:
        self.name, self.port, self.texts, self.model = name, port, texts, model
        self.path = "/v1/embeddings"
        self.idle: list[Conn] = []
        self.all: list[Conn] = []

    async def post(self, body: dict[str, Any]) -> np.ndarray:
        conn = self.idle.pop() if self.idle else self._new()
        try:
            raw = await conn.post(json.dumps(body).encode())
        except Exception as e:
            raise WorkFailed(f"{self.name}: POST {self.path}: {e}") from e
        self.idle.append(conn)
        data = sorted(json.loads(raw)["data"], key=lambda d: d["index"])
        return np.asarray([d["embedding"] for d in data], dtype=np.float32)

    def _new(self) -> Conn:
        conn = Conn(self.port, self.path)
        self.all.append(conn)
        return conn

    async def one(self, text: int) -> np.ndarray:
        return await self.post({"model": self.model, "input": self.texts[text]})

    async def many(self, texts: Sequence[int]) -> np.ndarray:
        return await self.post({"model": self.model, "input": [self.texts[i] for i in texts]})

    async def chunks(self, texts: Sequence[int], size: int, in_flight: int) -> np.ndarray:
        parts = [texts[k : k + size] for k in range(0, len(texts), size)]
        out: list[np.ndarray] = [np.empty(0)] * len(parts)
        todo = iter(enumerate(parts))

        async def sender() -> None:
            for k, part in todo:
                out[k] = await self.many(part)

        await asyncio.gather(*(sender() for _ in range(in_flight)))
        return np.concatenate(out)

    async def close(self) -> None:
        """Closes every connection (a phase starts with fresh ones: idle ones may be closed
        by the server meanwhile)."""
        for conn in self.all:
            conn.close()
        self.idle, self.all = [], []


class ClientDoor:
    """queueserve's ``AsyncClient`` with the serving object, so the caller computes the
    length-bucket batch key (``tasks.embed``'s natural use)."""

    def __init__(self, name: str, client: Any, serving: Any, texts: Sequence[str]) -> None:
        self.name, self.client, self.serving, self.texts = name, client, serving, texts

    async def one(self, text: int) -> Any:
        vector = await self.client.dispatch(self.serving, self.texts[text], timeout=GRACE_S)
        return np.asarray(vector)[None, :]

    async def chunks(self, texts: Sequence[int], size: int, in_flight: int) -> np.ndarray:
        items = [self.texts[i] for i in texts]
        out = [
            v
            async for v in self.client.map(
                self.serving, items, chunk_size=size, max_in_flight=in_flight, timeout=GRACE_S
            )
        ]
        return np.asarray(out)

    async def close(self) -> None:
        return None


async def bounded(what: str, work: Awaitable[Any], seconds: float) -> Any:
    """``work``, or WorkFailed when it is not done ``seconds`` past its own length."""
    try:
        return await asyncio.wait_for(work, seconds + GRACE_S)
    except TimeoutError:
        raise WorkFailed(f"{what}: not done {GRACE_S:g} s past its {seconds:g} s") from None


async def callers_rate(door: Door, checker: Checker, n: int, callers: int, seconds: float) -> float:
    """Texts/s of ``callers`` concurrent callers, each sending one text after another for
    ``seconds`` (closed loop), texts taken in turn from the corpus."""
    turn = itertools.count()
    done = 0

    async def caller(until: float) -> None:
        nonlocal done
        while time.perf_counter() < until:
            i = next(turn) % n
            checker.check(door.name, [i], await door.one(i))
            done += 1

    await asyncio.gather(*(door.one(c % n) for c in range(callers)))  # warm connections
    began = time.perf_counter()
    run = asyncio.gather(*(caller(began + seconds) for _ in range(callers)))
    await bounded(f"{door.name}: {callers} callers", run, seconds)
    return done / (time.perf_counter() - began)


async def chunks_rate(
    door: Door, checker: Checker, texts: Sequence[int], size: int, in_flight: int
) -> float:
    """Texts/s of ``texts`` sent in requests of ``size`` texts, ``in_flight`` at a time."""
    began = time.perf_counter()
    vectors = await bounded(
        f"{door.name}: requests of {size}", door.chunks(texts, size, in_flight), 0
    )
    took = time.perf_counter() - began
    checker.check(door.name, texts, vectors)
    return len(texts) / took


async def low_load(door: Door, checker: Checker, n: int, calls: int) -> list[float]:
    """Seconds of each of ``calls`` one-text calls made one at a time, sorted."""
    times = []
    for k in range(calls):
        i = (k * 7) % n  # a spread of lengths, the same for every system
        began = time.perf_counter()
        vector = await bounded(f"{door.name}: one caller", door.one(i), 0)
        times.append(time.perf_counter() - began)
        checker.check(door.name, [i], vector)
    return sorted(times)


async def open_loop(
    door: Door, checker: Checker, n: int, per_s: float, seconds: float, seed: int
) -> list[float]:
    """One-text calls at Poisson arrivals of ``per_s`` a second for ``seconds``, none
    waiting for those before; each call's seconds from its scheduled arrival to its answer
    (a late sender counts against the system, as a real arrival would), sorted."""
    arrivals = random.Random(seed)
    times: list[float] = []

    async def send(i: int, at: float) -> None:
        vector = await door.one(i)
        times.append(time.perf_counter() - at)
        checker.check(door.name, [i], vector)

    sends: list[asyncio.Future[None]] = []
    at = time.perf_counter()
    end = at + seconds
    while True:
        at += arrivals.expovariate(per_s)
        if at >= end:
            break
        if (delay := at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        sends.append(asyncio.ensure_future(send(len(sends) % n, at)))
    await bounded(f"{door.name}: open loop at {per_s:.1f}/s", asyncio.gather(*sends), 0)
    return sorted(times)


def ms(sorted_seconds: Sequence[float], q: float) -> float:
    return percentile(sorted_seconds, q) * 1000.0
