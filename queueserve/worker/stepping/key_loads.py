"""The key states of a step serving with ``load_key`` (docs/generation.md, "Many models"): the
batch keys whose states its running set holds, and the loads of those it needs.

The step executor holds one pin (``KeyStates.acquire``) per key while a sequence of the key
runs or a request of it is ready to join, and releases it at the first step boundary with
neither (its sequences ended, were cancelled, expired, failed or lost their caller): so a key
with running sequences is never evicted, and every key's state, once released, may be. A key
the executor does not hold is acquired by a loader thread (the load, or the wait for room
while every state held is pinned), so the sequences of other keys go on stepping meanwhile;
its requests join at the first boundary after their state is there. A load that raises
answers that key's waiting requests with its error (``KeyLoadError``'s body), and a request
of it that comes within the backoff at once; other keys run on.

Room is fair in arrival order (``plan``): once a waiting request needs a key that can only be
loaded by evicting a key the running set holds, the requests that came after it wait,
whatever their key, so the held keys drain and the load gets its room (``max_loaded_keys``;
a load waiting for ``max_loaded_bytes`` waits for releases without that rule).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager
from typing import Any

from queueserve.key_states import KeyLoadError, KeyStates
from queueserve.steps import StepServing, keyed
from queueserve.wire.error import ErrorBody, error_body
from queueserve.wire.kinds import ERROR
from queueserve.wire.tenants import split_lane
from queueserve.worker.pipeline.execute import Row
from queueserve.worker.stepping.calls import Member
from queueserve.worker.stepping.joins import StepQueue
from queueserve.worker.stepping.prefix_cache import PrefixCache

log = logging.getLogger(__name__)


def plan(waiting: Sequence[str], held: Collection[str], room: int) -> tuple[list[bool], list[str]]:
    """Which waiting requests (their batch keys, in arrival order) may join now, and the keys
    to load, in the order first needed. ``held``: the keys whose states the running set holds;
    ``room``: the most states a partition holds. A request of a held key may join unless an
    earlier one needs a key with no room left beside those held (then it waits for that load)."""
    ready: list[bool] = []
    loads: list[str] = []
    fits = set(held)  # held, and loads with room beside them
    short = False
    for key in waiting:
        if key in held:
            ready.append(not short)
            continue
        ready.append(False)
        if key not in loads:
            loads.append(key)
            if len(fits) < room:
                fits.add(key)
            else:
                short = True
    return ready, loads


class Keys:
    """A step serving without ``load_key``: no state, one prefix-cache trie for every key."""

    wanted: frozenset[str] = frozenset()  # the keys of requests waiting to join

    def loading(self, queue: StepQueue) -> bool:
        """Whether whatever waits, waits for a load (caller holds cond): nothing to do until
        it is done, a request comes, or a look at cancels and deadlines is due."""
        return False

    def follow(self, queue: StepQueue, running: list[Member]) -> tuple[list[Row], list[str]]:
        """Answer the requests of keys that failed to load, and plan the joins (caller holds
        cond): (rows to send, keys to ``release`` once it is let go)."""
        return [], []

    def trie(self, key: str) -> str:
        """Whose prefix-cache entries the requests of ``key`` (a lane) use."""
        return ""

    def calling(self, serving: StepServing, key: str) -> AbstractContextManager[None]:
        """Around each call of ``key``'s sequences: ``serving.key_state`` is its state."""
        return contextlib.nullcontext()

    def release(self, keys: list[str]) -> None:
        pass

    def stop(self) -> None:
        pass


class KeyLoads(Keys):
    """A step executor's pins of its keys' states and its loader thread. ``held`` and the
    methods but ``_loader`` belong to the executor's thread; the loader hands its outcomes
    over under ``cond`` (the executor's), and notifies it. With a prefix cache, each key has
    its own trie, dropped once the key's state left the partition."""

    def __init__(
        self, states: KeyStates, cond: threading.Condition, name: str, cache: PrefixCache | None
    ) -> None:
        self.states = states
        self.cond = cond
        self.name = name
        self.cache = cache
        self.held: dict[str, Any] = {}  # key -> its state, pinned once
        self.wanted: frozenset[str] = frozenset()  # keys of waiting requests (the LRU's hint)
        states.wanted = lambda: self.wanted
        self._last: dict[str, Any] = {}  # key -> the state it had when last taken
        self._asked: deque[str | None] = deque()  # keys for the loader (None: stop)
        self._asking: set[str] = set()  # asked and not yet taken back
        self._done: list[tuple[str, Any, ErrorBody | None]] = []  # (under cond)
        self._woken = threading.Condition()
        self._thread: threading.Thread | None = None
        self._quiet = False  # the last plan found none ready, and no load was done since
        self._planned = -1  # the queue's arrivals at the last plan

    def loading(self, queue: StepQueue) -> bool:
        return self._quiet and self._planned == queue.arrived

    def follow(self, queue: StepQueue, running: list[Member]) -> tuple[list[Row], list[str]]:
        failed, renewed = self.take_back()
        rows: list[Row] = []
        if failed:
            gone = [w for w in queue.waiting if split_lane(w.key)[0] in failed]
            for w in gone:
                body = failed[split_lane(w.key)[0]]
                rows.append((w.piece.request, w.piece.offset, w.slots, ERROR, body))
            queue.remove(gone)
        if self.cache is not None:  # a key's entries go with its state
            for key in renewed | (self.cache.keys() - self.live()):
                self.cache.drop_key(key)
        waiting = [w for w in queue.waiting if w.measured]
        keys = [split_lane(w.key)[0] for w in waiting]
        ready, release = self.plan(keys, {m.key for m in running})
        for w, r in zip(waiting, ready, strict=True):
            w.ready = r
        self._planned = queue.arrived
        return rows, release

    def trie(self, key: str) -> str:
        return split_lane(key)[0]

    def calling(self, serving: StepServing, key: str) -> AbstractContextManager[None]:
        return keyed(serving, self.held[key])

    def take_back(self) -> tuple[dict[str, ErrorBody], set[str]]:
        """The loads done since the last look (caller holds cond): the keys that failed, with
        their error, and the keys whose state is new (loaded again: entries of their old one
        must go)."""
        failed: dict[str, ErrorBody] = {}
        renewed: set[str] = set()
        for key, state, body in self._done:
            self._asking.discard(key)
            if body is not None:
                failed[key] = body
                continue
            self.held[key] = state
            if key in self._last and self._last[key] is not state:
                renewed.add(key)
            self._last[key] = state
        self._done.clear()
        return failed, renewed

    def plan(
        self, waiting: Sequence[str], running: Collection[str]
    ) -> tuple[list[bool], list[str]]:
        """Mark which waiting requests (their keys) may join, ask the loader for the keys they
        need, and return (ready, keys to release): held keys with neither a running sequence
        (``running``) nor a request ready (caller holds cond; release them after it)."""
        ready, loads = plan(waiting, self.held, self.states.max_keys)
        self.wanted = frozenset(waiting)
        in_use = set(running)
        in_use.update(key for key, r in zip(waiting, ready, strict=True) if r)
        release = [key for key in self.held if key not in in_use]
        for key in release:
            del self.held[key]
        asked = [key for key in loads if key not in self._asking]
        if asked:
            self._asking.update(asked)
            self._ask(asked)
        self._quiet = bool(waiting) and not any(ready) and not self._done
        return ready, release

    def live(self) -> set[str]:
        """The keys whose state the partition holds now (held here, or in its LRU)."""
        return set(self.held) | set(self.states.loaded)

    def release(self, keys: list[str]) -> None:
        """Let the states of ``keys`` go (they may be evicted now)."""
        for key in keys:
            self.states.release(key)

    def stop(self) -> None:
        """End the loader (nothing waits: every request was answered) and release all."""
        self._ask([None])
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        with self.cond:
            self.take_back()
            keys, self.held = list(self.held), {}
        self.release(keys)

    # -- the loader thread -------------------------------------------------------------------
    def _ask(self, keys: Sequence[str | None]) -> None:
        with self._woken:
            self._asked.extend(keys)
            self._woken.notify()
        if self._thread is None and keys != [None]:
            self._thread = threading.Thread(
                target=self._loader, name=f"queueserve-{self.name}-loader", daemon=True
            )
            self._thread.start()

    def _loader(self) -> None:
        while True:
            with self._woken:
                while not self._asked:
                    self._woken.wait()
                key = self._asked.popleft()
            if key is None:
                return
            state: Any = None
            body: ErrorBody | None = None
            try:
                state = self.states.acquire(key)
            except KeyLoadError as e:
                body = e.body
            except Exception as e:  # a bug here must not leave the key's requests waiting
                log.exception("serving %s: acquiring key %r failed", self.name, key)
                body = error_body(e)
            with self.cond:
                self._done.append((key, state, body))
                self._quiet = False
                self.cond.notify_all()
