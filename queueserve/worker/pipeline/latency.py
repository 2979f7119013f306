"""Batches that meet a latency target by themselves (the serving's ``max_latency``).

The worker learns how long a batch of n items (or cost units) takes, per serving and partition:
``BatchTimes`` fits t = a + b*n by least squares over the batches run, each older batch
weighing FORGET times less than the next, so the model follows a device that warms up or a
machine that gets busy. ``LatencyPlan`` then decides, for a batch filling up, when to close
it (``due``):

- as soon as it is big enough for the executor to keep up with the items arriving (their rate
  measured as they are read): at low load that is one item, so a lone request runs at once,
  as with ``batch_timeout=0``; under load batches grow just as far as the load needs;
- otherwise after waiting in the worker for as long as a batch costs whatever its size (a), at
  the latest when waiting longer would push its oldest item's expected answer (its wait so far,
  from when it was enqueued: in Redis too, and behind the batches before it, plus the batch's
  predicted time) past the target, less SAFETY of it for the read, the reply and the model's
  error.

``batch_timeout`` stays the upper bound: a batch never waits longer than it says. Pure logic,
no I/O: the clock is passed in.
"""

from __future__ import annotations

import math

FORGET = 0.95  # each batch weighs this much less than the next one in the fit
SAFETY = 0.2  # share of max_latency kept for reading, replying and the model's error
HEADROOM = 1.0  # a batch size keeps up when its time per item uses at most this share
RATE_S = 0.5  # the arrival rate is measured over about this long


class BatchTimes:
    """Seconds a batch of n items takes: a + b*n, fitted online with exponential forgetting."""

    __slots__ = ("_s0", "_sn", "_snn", "_snt", "_st", "a", "b", "batches")

    def __init__(self) -> None:
        self._s0 = self._sn = self._snn = self._st = self._snt = 0.0
        self.a = 0.0  # seconds a batch costs whatever its size
        self.b = 0.0  # seconds each item adds
        self.batches = 0

    def observe(self, n: float, seconds: float) -> None:
        if not (n > 0 and 0 <= seconds < math.inf):
            return
        f = FORGET
        self._s0 = f * self._s0 + 1
        self._sn = f * self._sn + n
        self._snn = f * self._snn + n * n
        self._st = f * self._st + seconds
        self._snt = f * self._snt + n * seconds
        self.batches += 1
        self._fit()

    def _fit(self) -> None:
        s0, sn, snn, st, snt = self._s0, self._sn, self._snn, self._st, self._snt
        spread = s0 * snn - sn * sn
        if spread > 1e-9 * s0 * snn:
            b = (s0 * snt - sn * st) / spread
            a = (st - b * sn) / s0
            if a >= 0 and b >= 0:
                self.a, self.b = a, b
                return
        # One batch size so far (or a fit that says a size costs nothing or less than
        # nothing): every item costs the same, which overstates what a bigger batch takes,
        # so batches close early rather than late.
        self.a, self.b = 0.0, st / sn

    def predict(self, n: float) -> float:
        return self.a + self.b * n


class LatencyPlan:
    """When a batch filling up should close to answer within ``target`` seconds."""

    __slots__ = ("_at", "_level", "target", "times")

    def __init__(self, target: float, times: BatchTimes) -> None:
        self.target = target
        self.times = times
        self._level = 0.0  # items read lately, decaying over RATE_S
        self._at = 0.0

    def arrived(self, items: int, now: float) -> None:
        self._level = self._level * math.exp(-(now - self._at) / RATE_S) + items
        self._at = now

    def rate(self, now: float) -> float:
        """Items arriving per second, lately."""
        return self._level * math.exp(-(now - self._at) / RATE_S) / RATE_S

    def due(self, started: float, weight: float, now: float, since: float | None = None) -> float:
        """When a batch of ``weight`` whose clock started at ``started`` should close, its
        oldest item enqueued at ``since`` (default: ``started``)."""
        times = self.times
        if times.batches == 0:
            return now  # nothing learned yet: run, and learn
        rate = self.rate(now)
        spare = HEADROOM - rate * times.b
        if spare > 0 and weight * spare >= rate * times.a:
            return now  # this size keeps up with what arrives: waiting only adds latency
        # Waiting saves the items that come meanwhile a batch's fixed cost (a) each; waiting
        # longer than that costs the items waiting more than it saves them.
        run = times.predict(weight)
        since = started if since is None else since
        return min(started + times.a, since + self.target * (1 - SAFETY) - run)
