"""Timing that workers and clients must agree on: heartbeats, liveness, reclaim, retries.

Each value is named once here; every module that needs one imports it. The relations between
them are the contract: a worker beats every ``HEARTBEAT_EVERY_S``, so a consumer silent for
``DEAD_AFTER_S`` (four missed beats) is dead and its entries are reclaimed by the live ones,
which look every ``RECLAIM_EVERY_S``. A SIGKILLed worker's requests are answered within about
``DEAD_AFTER_S + HEARTBEAT_EVERY_S + RECLAIM_EVERY_S`` plus one batch (3 s here, against 7 s with
the earlier 1 s / 5 s / 1 s). The price of a shorter ``DEAD_AFTER_S``: a worker whose heartbeat
thread is starved that long (SIGSTOP, swapping, a C extension holding the GIL for seconds) has
its entries taken and run again elsewhere; callers still get one answer, the batch function runs
twice. Heartbeats cost one Redis round trip per partition per beat.
"""

from __future__ import annotations

HEARTBEAT_EVERY_S = 0.5
# The registry record and the per-serving worker set expire this long after the last beat, so
# a worker that vanished leaves nothing behind for good.
HEARTBEAT_TTL_MS = 30_000
DEAD_AFTER_S = 2.0  # a consumer with no heartbeat for this long is dead: its entries are taken
RECLAIM_EVERY_S = 0.5
# A dead consumer's entry is taken once it has been idle this long: a claim resets the idle
# time, so two live consumers racing for it never both get it. Shorter than DEAD_AFTER_S, so
# the entries of a partition its supervisor saw die (and took off the live set at once) are
# taken at the next pass, not DEAD_AFTER_S after their delivery.
CLAIM_IDLE_S = 0.5
FORGET_EVERY_S = 30.0  # how often dead consumers holding nothing leave the consumer group
# "Alive" as operators and callers are told it (stats, readiness, a Timeout's message): more
# forgiving than DEAD_AFTER_S, so a slow beat is not reported as a missing worker.
ALIVE_WITHIN_S = 10.0
# The servings registry (P:servings) lists a serving while a worker declared it or beat for it
# within this long; workers drop older entries at each beat and readers skip them, so a
# serving whose workers are gone leaves the listings after a week (its keys stay).
SERVINGS_FORGET_S = 7 * 24 * 3600.0
# A streaming caller (``client.stream``) is gone when its client's event channel has had no
# subscriber for CALLER_GONE_AFTER_S: Redis drops a subscription as soon as its client closes or
# its process dies, while a live client that lost its connection subscribes again within
# BACKOFF_MAX_S of Redis answering. Step servings look every CALLER_CHECK_EVERY_S, between steps.
CALLER_GONE_AFTER_S = 10.0
CALLER_CHECK_EVERY_S = 1.0
# How long a send keeps retrying while Redis cannot serve before the caller gets the error.
RECONNECT_WITHIN_S = 30.0
# Backoff between retries against a Redis that cannot serve: doubling from the first to the
# last, so a blip costs milliseconds and a long outage one attempt every two seconds.
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 2.0


def backoff(attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (0, 1, ...) against a Redis that cannot serve."""
    return min(BACKOFF_FIRST_S * 2.0 ** min(attempt, 32), BACKOFF_MAX_S)


# How long a durable enqueue waits for a replica to acknowledge it (WAIT 1 <ms>) before the
# caller gets NotReplicated. Replicas on a LAN answer in about a millisecond; a second covers a
# replica catching up after a pause without holding callers for long.
DURABLE_WAIT_MS = 1000
