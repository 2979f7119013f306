"""The states of batch keys one partition holds: what a serving's ``load_key`` returned for each
key, least recently used first, within ``max_loaded_keys`` states and ``max_loaded_bytes``.

A batch *acquires* its key's state before it runs (loading it if it is not held: in the
preparation stage, off the device's thread) and *releases* it once it ran. A state acquired and
not yet released is pinned: it is never evicted, so a batch in flight never loses its model.
Room for a key is made before its load, by evicting unpinned states from the least recently
used on, but those of keys whose work waits here to run (``wanted``: read, or taken and not yet
on the device) last, each handed to ``unload_key`` once it left; when every state held is
pinned, the load waits for a batch to finish. Two batches of one key share one load. At most
``max_loading`` keys load at once (a quarter of ``max_loaded_keys``, at least 1), so the loads
in progress never take the room of the states used most: with every preparer loading, a state
would be evicted as soon as its batch ran (the reads load one key at a time too:
worker/pipeline/affinity.py).

Bytes: a state is measured once loaded (``state_bytes``). Room is made before a load for as
many bytes as that key's state took last time (for a key never loaded here, the largest state
seen so far), and after it for what the state really takes: the bound holds for what the LRU
holds; a key whose first state is larger than any before may pass it by that difference while
its load runs, until room is made.

A load that raises fails the batch that asked for it (``KeyLoadError`` carries the error body
its requests get); the key is tried again at its next batch, after a backoff that doubles with
each failure in a row (BACKOFF_FIRST_S to BACKOFF_MAX_S); batches of it meanwhile fail at once,
saying when the next try is. Nothing else waits for it: other keys load and run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from queueserve.errors import QueueServeError
from queueserve.wire.error import ErrorBody, error_body

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


class KeyLoadError(QueueServeError):
    """A key's state could not be had: ``body`` is the error its batch's requests get (the
    worker answers them with it; callers see a RemoteError)."""

    def __init__(self, body: ErrorBody) -> None:
        super().__init__(body[1])
        self.body = body


def has_key_states(serving: object) -> bool:
    """Whether ``serving`` runs its batches with their key's state: it defines
    ``load_key(self, key)`` (and may define ``unload_key(self, key, state)`` and
    ``state_bytes(self, state)``; docs/usage.md, "Many models behind one serving")."""
    return callable(getattr(serving, "load_key", None))


class KeyEvents:
    """What a partition's metrics hear of its key states (no-ops here)."""

    def loaded(self, key: str, seconds: float, ok: bool) -> None:
        """``load_key`` returned (``ok``) or raised after ``seconds``."""

    def evicted(self, key: str) -> None:
        """A state left the LRU (``unload_key`` was called with it)."""

    def used(self, hit: bool, held: int) -> None:
        """A batch acquired its key's state: held already (``hit``) or loaded for it (once
        held); ``held``: the states held now."""


@dataclass(slots=True)
class _Held:
    state: Any
    size: int
    pins: int = 0


@dataclass(slots=True)
class _Failed:
    tries: int
    retry_at: float
    body: ErrorBody


class KeyStates:
    """One partition's LRU of key states (thread-safe: preparers and executors share it)."""

    def __init__(
        self,
        load: Callable[[str], Any],
        unload: Callable[[str, Any], None] | None = None,
        size: Callable[[Any], int] | None = None,
        *,
        max_keys: int,
        max_bytes: int = 0,
        events: KeyEvents | None = None,
        name: str = "",
    ) -> None:
        self._load = load
        self._unload = unload
        self._size = size
        self.max_keys = max_keys
        self.max_bytes = max_bytes  # 0: no bound
        # Loads at once, a quarter of the room: the rest keeps the states used most recently
        self.max_loading = max(1, max_keys // 4)
        self.events = events or KeyEvents()
        self.name = name
        self._cond = threading.Condition()
        self._held: OrderedDict[str, _Held] = OrderedDict()  # least recently used first
        self._loading: dict[str, int] = {}  # key -> bytes reserved for it
        self._failed: dict[str, _Failed] = {}
        self._sizes: dict[str, int] = {}  # what each key's state took when last held
        self._largest = 0
        self.bytes = 0  # of the states held
        self.mean_load_s = 0.0  # a moving average of load_key's time
        self.loaded: frozenset[str] = frozenset()  # the keys held, as last changed (no lock)
        # The keys whose batches wait here to run (read, not yet on the device): needed next
        self.wanted: Callable[[], Collection[str]] = frozenset

    @classmethod
    def of(cls, serving: Any, events: KeyEvents | None = None) -> KeyStates:
        """A new LRU of ``serving``'s key states (one per partition; ``has_key_states``)."""
        return cls(
            serving.load_key,
            getattr(serving, "unload_key", None),
            getattr(serving, "state_bytes", None),
            max_keys=serving.max_loaded_keys,
            max_bytes=serving.max_loaded_bytes,
            events=events,
            name=serving.name,
        )

    def held(self) -> list[str]:
        """The keys held or being loaded, least recently used first."""
        with self._cond:
            return [*self._held, *self._loading]

    def acquire(self, key: str) -> Any:
        """``key``'s state, pinned until ``release(key)``: loaded first when not held (the
        caller's thread runs the load). Raises KeyLoadError when it cannot be had."""
        wanted = frozenset() if key in self._held else self.wanted()  # (a hint: no lock)
        with self._cond:
            while True:
                held = self._held.get(key)
                if held is not None:
                    held.pins += 1
                    self._held.move_to_end(key)
                    self.events.used(True, len(self._held))
                    return held.state
                if key not in self._loading and len(self._loading) < self.max_loading:
                    self._check_backoff(key)
                    reserve = self._sizes.get(key, self._largest)
                    evicted = self._make_room(reserve, len(self._loading) + 1, wanted)
                    if evicted is not None:
                        self._loading[key] = reserve
                        break
                self._cond.wait()
        self._unload_all(evicted)
        return self._load_pinned(key)

    def release(self, key: str) -> None:
        """The batch that acquired ``key``'s state is done with it."""
        with self._cond:
            held = self._held.get(key)
            if held is not None and held.pins > 0:
                held.pins -= 1
                if held.pins == 0:
                    self._cond.notify_all()

    def _check_backoff(self, key: str) -> None:
        failed = self._failed.get(key)
        if failed is None:
            return
        wait = failed.retry_at - time.monotonic()
        if wait > 0:
            kind, message, tb, error_kind = failed.body
            raise KeyLoadError(
                [
                    kind,
                    f"{message} (failed {failed.tries}x; next try in {wait:.1f}s)",
                    tb,
                    error_kind,
                ]
            )

    def _make_room(
        self, reserve: int, loading: int, wanted: Collection[str] = frozenset()
    ) -> list[tuple[str, Any]] | None:
        """Evict unpinned states, least recently used first, until ``loading`` keys more and
        ``reserve`` bytes more fit (caller holds the lock); the evicted (key, state) pairs, for
        the caller to unload after the lock, or None when pinned states leave no room yet
        (nothing is evicted then)."""
        over_keys = len(self._held) + loading - self.max_keys
        reserved = sum(self._loading.values())
        over_bytes = self.bytes + reserved + reserve - self.max_bytes if self.max_bytes else 0
        if over_keys <= 0 and over_bytes <= 0:
            return []
        chosen: list[str] = []
        for key in evict_order(self._held, wanted):
            if over_keys <= 0 and over_bytes <= 0:
                break
            held = self._held[key]
            if held.pins == 0:
                chosen.append(key)
                over_keys -= 1
                over_bytes -= held.size
        if over_keys > 0 or over_bytes > 0:
            if not self._held and not self._loading:  # an empty LRU: nothing to wait for
                return []
            return None
        return [self._evict(key) for key in chosen]

    def _evict(self, key: str) -> tuple[str, Any]:
        held = self._held.pop(key)
        self.loaded = frozenset(self._held)
        self.bytes -= held.size
        return key, held.state

    def _unload_all(self, evicted: list[tuple[str, Any]]) -> None:
        for key, state in evicted:
            self._unload_one(key, state)
            self.events.evicted(key)

    def _unload_one(self, key: str, state: Any) -> None:
        if self._unload is not None:
            try:
                self._unload(key, state)
            except Exception:  # the state is dropped all the same
                log.exception("serving %s: unload_key(%r) raised", self.name, key)

    def _load_pinned(self, key: str) -> Any:
        started = time.perf_counter()
        try:
            state = self._load(key)
            size = max(0, int(self._size(state))) if self._size is not None else 0
            if self.max_bytes and size > self.max_bytes:
                self._unload_one(key, state)
                raise ValueError(
                    f"the state of batch key {key!r} takes {size} bytes (state_bytes), more "
                    f"than max_loaded_bytes={self.max_bytes} of serving {self.name!r}: raise "
                    "max_loaded_bytes"
                )
        except Exception as e:
            self._failed_load(key, e, time.perf_counter() - started)
            raise KeyLoadError(self._failed[key].body) from e
        took = time.perf_counter() - started
        self.events.loaded(key, took, True)
        with self._cond:
            self.mean_load_s = took if not self.mean_load_s else 0.8 * self.mean_load_s + 0.2 * took
            self._failed.pop(key, None)
        return self._admit(key, state, size)

    def _admit(self, key: str, state: Any, size: int) -> Any:
        """Hold the loaded state, pinned, once its bytes fit (evicting as needed)."""
        while True:
            with self._cond:
                self._loading[key] = 0  # what it takes now counts, not what was reserved
                evicted = self._make_room(size, len(self._loading))
                if evicted is not None:
                    del self._loading[key]
                    self._held[key] = _Held(state, size, pins=1)
                    self.loaded = frozenset(self._held)
                    self.bytes += size
                    self._sizes[key] = size
                    self._largest = max(self._largest, size)
                    self.events.used(False, len(self._held))
                    self._cond.notify_all()
                else:
                    self._cond.wait()
            if evicted is not None:
                self._unload_all(evicted)
                return state

    def _failed_load(self, key: str, e: Exception, took: float) -> None:
        self.events.loaded(key, took, False)
        with self._cond:
            del self._loading[key]
            tries = self._failed[key].tries + 1 if key in self._failed else 1
            backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (tries - 1))
            body = error_body(e)
            body[1] = f"load_key({key!r}) raised: {body[1]}"
            self._failed[key] = _Failed(tries, time.monotonic() + backoff, body)
            self._cond.notify_all()
        log.warning(
            "serving %s: load_key(%r) raised %s: %s; its batches fail for %.1fs, then it is "
            "tried again",
            self.name,
            key,
            type(e).__name__,
            e,
            backoff,
        )


def evict_order(held: Iterable[str], wanted: Collection[str]) -> list[str]:
    """The order the states of ``held`` (least recently used first) are evicted in: least
    recently used first, but the keys of ``wanted`` (work for them waits here) last, as the
    offline optimum evicts the state needed furthest ahead."""
    return sorted(held, key=lambda key: key in wanted)


@contextlib.contextmanager
def holding(states: KeyStates | None, key: str) -> Iterator[Any]:
    """``key``'s state while the block runs (None without ``states``), as ``serving.inline``
    runs a batch: a load that raises raises its own error here."""
    if states is None:
        yield None
        return
    try:
        state = states.acquire(key)
    except KeyLoadError as e:
        raise (e.__cause__ or e) from None
    try:
        yield state
    finally:
        states.release(key)
