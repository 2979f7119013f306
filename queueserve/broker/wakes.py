"""Idle servings block together: one XREAD of all their wake streams, on one connection.

A worker blocks on a serving's wake stream whenever nothing is ready for it (``Reads.
wait_then_read``: XREAD BLOCK, then read.lua, in one round trip), on a connection held for the
block: one connection per serving, always, since an idle worker blocks all the time. A
partition of 130 idle servings held 130 at once, and ran out of redis-py's pool of 100. So a
serving with no work since it started, or whose last IDLE_ROUNDS blocking reads came back
empty, waits here instead: one thread blocks on the wake streams of every such serving in one
XREAD (``WakeWatch``), and wakes the serving whose stream got an entry, which then runs
read.lua on a pooled connection. A partition's connections grow with the servings that have
work, not with those it runs, and an idle serving makes no round trip of its own.

Before each XREAD, in the same write, ready.lua looks for work in the watched servings' ready
sets: work becomes ready with an entry on its wake stream, and this finds what became ready
otherwise (a key another worker left unread, a member anyone may write), as each serving's
read.lua after its block did. So a wait that times out needs no read: nothing became ready.

What it costs: the first request after an idle spell takes a round trip and a thread wake-up
more (the XREAD's reply, then read.lua); the serving then blocks on its own again, its read
fused, until it is idle again. A busy serving never waits here, and one item's path is the
same.

A stream is covered only by an XREAD sent after it was watched, reading after an id no newer
than its waiter's: Redis returns at once what came after that id. A waiter whose stream is not
covered yet (just watched, or woken and taken) blocks on its own this time (``wait`` returns
None), so nothing waits for the watch's next turn. One XREAD cannot span cluster slots, nor
one script: plain servers and Sentinel masters only (``Reads``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from redis.exceptions import NoScriptError

from queueserve.broker import raw
from queueserve.broker.common import load_script
from queueserve.broker.redis_errors import redis_errors
from queueserve.broker.retry import Outage, RedisFailure, Retry

log = logging.getLogger(__name__)

IDLE_ROUNDS = 10  # empty blocking reads in a row (a second, at 100 ms each) before watching
WATCH_BLOCK_MS = 100  # one XREAD blocks this long at most; it is then sent anew


def stream_id(entry_id: bytes) -> tuple[int, int]:
    """An entry id as numbers, to compare (``b"1700000000000-3"`` -> (1700000000000, 3))."""
    ms, _, seq = entry_id.partition(b"-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:  # (Redis writes every id: not one it sent)
        return 0, 0


class _Watched:
    """One serving watched: its ready set, the wake id to read after, and what woke it (the
    entry, or work found ready) until its waiter takes it; meanwhile it is left out of the
    XREADs."""

    __slots__ = ("after", "ready", "ready_key", "waiters", "woken")

    def __init__(self, ready_key: str, after: bytes) -> None:
        self.ready_key = ready_key
        self.after = after
        self.woken: bytes | None = None
        self.ready = False
        self.waiters: list[threading.Event] = []

    @property
    def idle(self) -> bool:
        return self.woken is None and not self.ready


class WakeWatch:
    """The wake streams of a broker's idle servings, watched by one thread."""

    def __init__(self, connections: raw.Connections, outage: Outage, url: str) -> None:
        self._connections = connections
        self._outage = outage
        self._url = url
        self._script = load_script("ready.lua")
        self._sha = ""  # of ready.lua, once loaded
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the thread waits here for streams
        self._watched: dict[str, _Watched] = {}
        self._sent: dict[str, bytes] = {}  # the XREAD in flight (or about to be): its streams
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def wait(self, stream: str, ready_key: str, after: bytes, timeout: float) -> bool | None:
        """Wait until ``stream`` gets an entry after ``after``, or work is found in the ready
        set ``ready_key`` (True), or ``timeout`` seconds pass (False: nothing became ready);
        None when no XREAD covers the stream yet: the caller blocks on its own this time, and
        the next XREAD covers the stream."""
        with self._lock:
            if self._stop.is_set():
                return None
            watched = self._watched.get(stream)
            if watched is None:
                self._watched[stream] = _Watched(ready_key, after)
                self._start()
                return None
            if stream_id(after) > stream_id(watched.after):
                watched.after = after
            if not watched.idle:
                woke = watched.ready or stream_id(watched.woken or b"") > stream_id(after)
                watched.woken, watched.ready = None, False
                return True if woke else None  # (an entry it read already: not covered)
            sent = self._sent.get(stream)
            if sent is None or stream_id(sent) > stream_id(after):
                return None
            event = threading.Event()
            watched.waiters.append(event)
        event.wait(timeout)
        with self._lock:
            watched.waiters.remove(event)
            if event.is_set():  # (set since the wait timed out, too: taken now)
                watched.woken, watched.ready = None, False
                return True
        return False

    def forget(self, stream: str) -> None:
        """Stop watching ``stream`` (its serving has work: it blocks on its own again)."""
        with self._lock:
            watched = self._watched.pop(stream, None)
            for event in [] if watched is None else watched.waiters:
                event.set()

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            self._work.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1 + WATCH_BLOCK_MS / 1000)

    def _start(self) -> None:
        """Start the watching thread, once (caller holds the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="queueserve-wake-watch", daemon=True
            )
            self._thread.start()
        self._work.notify()

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:
            # A bug: every waiter blocks on its own from now on (wait finds no XREAD covering
            # its stream), as before there was a watch; said once, the worker serves on.
            log.exception("%s: the wake watch stopped; idle servings block one by one", self._url)
            with self._lock:
                self._stop.set()
                self._sent = {}
                self._wake_all()

    def _loop(self) -> None:
        retry = Retry(self._outage, "wake watch")
        while True:
            with self._lock:
                streams = self._streams()
                while not streams and not self._stop.is_set():
                    self._sent = {}
                    self._work.wait()
                    streams = self._streams()
                if self._stop.is_set():
                    self._sent = {}
                    return
                self._sent = {stream: after for stream, after, _ in streams}
            try:
                self._watch(streams)
            except RedisFailure as e:
                with self._lock:
                    self._sent = {}  # nothing covered: waiters block on their own meanwhile
                    self._wake_all()  # (and those waiting look for themselves now)
                self._stop.wait(retry.failed(e))
                continue
            retry.succeeded()

    def _wake_all(self) -> None:
        """Wake every waiter to read for itself: what covered it is gone (caller holds the
        lock)."""
        for watched in self._watched.values():
            if watched.waiters:
                watched.ready = True
                for event in watched.waiters:
                    event.set()

    def _streams(self) -> list[tuple[str, bytes, str]]:
        """(stream, the id to read after, ready set) of the servings the next XREAD watches
        (caller holds the lock)."""
        return [(s, w.after, w.ready_key) for s, w in self._watched.items() if w.idle]

    def _watch(self, streams: list[tuple[str, bytes, str]]) -> None:
        """One turn: ready.lua, then the XREAD, in one write; wake whom each finds."""
        names, ids, ready_keys = zip(*streams, strict=True)
        with redis_errors(self._url):
            if not self._sha:
                (sha,) = raw.run(self._connections, [("SCRIPT", "LOAD", self._script)])
                if isinstance(sha, Exception):
                    raise sha
                self._sha = sha.decode()
            sent = raw.send(
                self._connections,
                [
                    ("EVALSHA", self._sha, len(ready_keys), *ready_keys),
                    ("XREAD", "COUNT", 1, "BLOCK", WATCH_BLOCK_MS, "STREAMS", *names, *ids),
                ],
            )
            (found,) = sent.read(1)
            if isinstance(found, Exception):
                sent.abandon()
                if isinstance(found, NoScriptError):  # Redis restarted or flushed its scripts
                    self._sha = ""
                    return
                raise found
            self._found_ready(names, found)
            (reply,) = sent.read(1)
            if isinstance(reply, Exception):  # a key of another type (anyone may write one)
                raise reply
        self._woke(reply)

    def _found_ready(self, streams: tuple[str, ...], positions: list[int]) -> None:
        with self._lock:
            for position in positions:
                watched = self._watched.get(streams[position - 1])
                if watched is not None:
                    watched.ready = True
                    for event in watched.waiters:
                        event.set()

    def _woke(self, reply: Any) -> None:
        """Wake the waiters of each stream with an entry after its id. An entry no newer than
        the id a waiter gave since was read by that waiter already."""
        found = reply.items() if isinstance(reply, dict) else reply or ()
        with self._lock:
            for name, entries in found:
                watched = self._watched.get(name.decode() if isinstance(name, bytes) else name)
                if watched is None or not entries:
                    continue
                entry_id = entries[0][0]
                if stream_id(entry_id) > stream_id(watched.after):
                    watched.woken = entry_id
                    for event in watched.waiters:
                        event.set()
