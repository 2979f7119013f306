"""The one warning a client gives when a call waits on a serving no live worker serves."""

from __future__ import annotations

import difflib
import logging
import threading

from queueserve.broker.urls import redact_url
from queueserve.client.targets import Target
from queueserve.wire.timing import ALIVE_WITHIN_S

log = logging.getLogger("queueserve.client")

# How long a call waits before the client asks whether any worker serves it (and warns if not).
UNSERVED_WARN_AFTER = 10.0


class UnservedWatch:
    """Tells, once per serving per client, that a call is waiting on a serving no live worker
    serves: without a timeout such a call would otherwise wait in silence for ever."""

    def __init__(self, url: str, prefix: str) -> None:
        self.after = UNSERVED_WARN_AFTER
        self._url = url
        self._prefix = prefix
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def first_wait(self, serving: str, limit: float | None) -> float | None:
        """How long to wait before asking whether a worker is alive; None: do not ask (warned
        already, or the call's own limit comes first)."""
        if serving in self._warned or (limit is not None and limit <= self.after):
            return None
        return self.after

    def check(self, target: Target, alive: int | None) -> None:
        """Warn when ``alive`` (workers with a recent heartbeat; None: Redis did not say) is 0."""
        name = target.keys.name
        with self._lock:
            if alive != 0 or name in self._warned:
                return
            self._warned.add(name)
        url = redact_url(self._url)
        prefix = "" if self._prefix == "qs" else f" --prefix {self._prefix}"
        log.warning(
            "serving %r: a call has waited %gs and no worker is alive for it (none sent a "
            "heartbeat in the last %gs) on Redis %s, prefix %r. Start one with `queueserve "
            "worker module:attr --redis-url %s%s`; the call keeps waiting (pass timeout= or set "
            "QUEUESERVE_DEFAULT_TIMEOUT to bound calls)",
            name,
            self.after,
            ALIVE_WITHIN_S,
            url,
            self._prefix,
            url,
            prefix,
        )


def unknown_serving_message(name: str, known: list[str], prefix: str, url: str) -> str:
    """Why a call to ``name`` failed: no worker declared it; the declared names, closest
    first."""
    ranked = sorted(known, key=lambda k: -difflib.SequenceMatcher(None, name, k).ratio())
    listed = ", ".join(map(repr, ranked)) if ranked else "none yet"
    return (
        f"no worker has declared a serving named {name!r} under prefix {prefix!r} on Redis "
        f"{url}; declared servings, closest first: {listed}. Check the name, the prefix and "
        "the Redis URL; a client started before its workers passes wait_for_worker=True "
        "(or sets QUEUESERVE_WAIT_FOR_WORKER=1) to wait for them"
    )
