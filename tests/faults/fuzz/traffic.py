"""Valid traffic that runs while the fuzzer writes: sync and async clients, single calls
(half of them from a caller's span: with trace context), bursts of submits (which travel as
packs), priorities and batch keys, a generator serving's stream and a step serving; a client
made anew now and then (it reads the serving's meta hash). Every answer is checked against
what the serving must return."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

import queueserve as qs
from queueserve.wire.priority import MAX_PRIORITY
from tests.faults.fuzz import app
from tests.support.helpers import WAIT_S
from tests.support.step_app import expected

NEW_CLIENT_EVERY = 25  # calls: a new client reads the meta hash of a serving it names


@dataclass
class Tally:
    """What the traffic sent and got, shared by its threads."""

    sent: int = 0
    answered: int = 0
    items: list[str] = field(default_factory=list)  # items answered, each must have run once
    wrong: list[str] = field(default_factory=list)  # what went wrong, said in full
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self) -> None:
        with self.lock:
            self.sent += 1

    def check(self, what: str, got: Any, want: Any, items: Sequence[str] = ()) -> None:
        with self.lock:
            if got == want:
                self.answered += 1
                self.items.extend(items)
            else:
                self.wrong.append(f"{what}: got {got!r}, want {want!r}")

    def failed(self, what: str, error: BaseException) -> None:
        with self.lock:
            self.wrong.append(f"{what}: raised {error!r}")


class Traffic:
    """Threads sending valid requests until ``stop``; ``on_client(client_id)`` learns each
    client made, for the fuzzer to attack its inbox and events channel."""

    def __init__(self, url: str, prefix: str, seed: int, on_client: Callable[[str], None]) -> None:
        self.url = url
        self.prefix = prefix
        self.seed = seed
        self.on_client = on_client
        self.tally = Tally()
        self.stopping = threading.Event()
        self._ids = itertools.count()
        self._tracer = TracerProvider().get_tracer("tests.fuzz")  # not the process's provider
        self.threads = [
            threading.Thread(target=self._guard, args=(name, run), name=f"fuzz-{name}", daemon=True)
            for name, run in (
                ("sync", self._sync),
                ("async", self._async),
                ("stream", self._streams),
            )
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(WAIT_S * 2)
            if t.is_alive():
                self.tally.failed(t.name, TimeoutError("still running after the fuzzing"))

    def _guard(self, name: str, run: Callable[[], None]) -> None:
        try:
            run()
        except BaseException as e:  # reported by the test, with the rest
            self.tally.failed(f"{name} traffic thread", e)

    def _client(self) -> qs.Client:
        client = qs.Client(self.url, prefix=self.prefix)
        self.on_client(client.client_id)
        return client

    def _item(self, kind: str) -> str:
        return f"{kind}-{next(self._ids)}"

    # -- sync: dispatch by name, bursts of submits (packs), priorities, batch keys ---------
    def _sync(self) -> None:
        rng = random.Random(self.seed)
        client = self._client()
        try:
            for n in itertools.count():
                if self.stopping.is_set():
                    return
                if n and n % NEW_CLIENT_EVERY == 0:
                    client.close()
                    client = self._client()
                if n % 3:
                    self._dispatch(client, rng)
                else:
                    self._burst(client, rng)
        finally:
            client.close()

    def _dispatch(self, client: qs.Client, rng: random.Random) -> None:
        item = self._item("s")
        self.tally.send()
        # Every other call from a span of the caller's: its context goes in the header
        # (a valid "trace" field beside the fuzzer's hostile ones)
        span = self._tracer.start_as_current_span("fuzz caller") if rng.random() < 0.5 else None
        try:
            with span or contextlib.nullcontext():
                got = client.dispatch(
                    "fz", item, timeout=WAIT_S, priority=rng.choice((0, 0, 5, MAX_PRIORITY))
                )
        except qs.QueueServeError as e:
            self.tally.failed(f"dispatch {item}", e)
            return
        self.tally.check(f"dispatch {item}", got, app.answer(item), [item])

    def _burst(self, client: qs.Client, rng: random.Random) -> None:
        tickets = []
        for _ in range(rng.randrange(2, 9)):
            items = [self._item("b") for _ in range(rng.randrange(1, 4))]
            self.tally.send()
            key = rng.choice(("default", "k2"))
            tickets.append(
                (
                    items,
                    client.submit(
                        app.plain, items, batch_key=key, timeout=WAIT_S, priority=rng.randrange(3)
                    ),
                )
            )
        for items, ticket in tickets:
            try:
                got = ticket.result(WAIT_S)
            except qs.QueueServeError as e:
                self.tally.failed(f"submit {items}", e)
                continue
            self.tally.check(f"submit {items}", got, [app.answer(x) for x in items], items)

    # -- async: dispatch and dispatch_many ------------------------------------------------
    def _async(self) -> None:
        asyncio.run(self._async_loop())

    async def _async_loop(self) -> None:
        client = qs.AsyncClient(self.url, prefix=self.prefix)
        self.on_client(client.client_id)
        try:
            while not self.stopping.is_set():
                items = [self._item("a") for _ in range(3)]
                self.tally.send()
                self.tally.send()
                try:
                    one, many = await asyncio.gather(
                        client.dispatch("fz", items[0], timeout=WAIT_S),
                        client.dispatch_many(app.plain, items[1:], timeout=WAIT_S),
                    )
                except qs.QueueServeError as e:
                    self.tally.failed(f"async {items}", e)
                    continue
                self.tally.check(f"async dispatch {items[0]}", one, app.answer(items[0]), items[:1])
                self.tally.check(
                    f"async dispatch_many {items[1:]}",
                    many,
                    [app.answer(x) for x in items[1:]],
                    items[1:],
                )
        finally:
            await client.aclose()

    # -- a generator serving's stream, and a step serving ---------------------------------
    def _streams(self) -> None:
        client = self._client()
        try:
            for n in itertools.count():
                if self.stopping.is_set():
                    return
                if n % 2:
                    self._stream(client)
                else:
                    self._step(client, n)
        finally:
            client.close()

    def _stream(self, client: qs.Client) -> None:
        item = self._item("g")
        self.tally.send()
        try:
            outputs = [
                v
                for e in client.stream(app.steps, [item], timeout=WAIT_S)
                if isinstance(e, qs.Output)
                for v in e.results
            ]
        except qs.QueueServeError as e:
            self.tally.failed(f"stream {item}", e)
            return
        self.tally.check(f"stream {item}", outputs, [f"{item}:{i}" for i in range(3)], [item])

    def _step(self, client: qs.Client, n: int) -> None:
        item = {"n": 1 + n % 5, "base": n, "prompt": "ab" * (n % 4)}
        self.tally.send()
        try:
            got = client.dispatch(app.generate, item, timeout=WAIT_S)
        except qs.QueueServeError as e:
            self.tally.failed(f"step serving {item}", e)
            return
        self.tally.check(f"step serving {item}", got, expected(item))
