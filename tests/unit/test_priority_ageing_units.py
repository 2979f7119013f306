"""Priority ageing inside one batch key's queue (batching.py), on a clock the test passes in:
a level ranks from when it last gave a batch items, or when its head was enqueued if later,
minus one second per level, as read.lua ranks a key's streams in Redis."""

from __future__ import annotations

from queueserve.worker.pipeline.batching import Assembler, Request, Slice

_ids = iter(range(1, 10**9))


def enqueued(at: float, priority: int, item: str) -> Slice:
    """One item whose entry was written at unix time ``at``."""
    rid = next(_ids)
    request = Request(f"{int(at * 1000)}-{rid}".encode(), "qs:{s}:in:k", rid, "qs:inbox:c", 0.0, 1)
    request.priority = priority
    return Slice(request, 0, [item])


def test_a_low_priority_runs_once_it_waited_its_levels_worth_however_long_the_flood() -> None:
    # Given batches of one item, and a priority-0 request enqueued at 100 s that the ready
    # set hands over 9 s later, behind a backlog of priority-9 work (each enqueued 5 s before
    # it is read)
    a = Assembler(capacity=1, timeout=0.0, age_per_priority=1.0, unix_offset=0.0)
    a.add("k", enqueued(100.0, 0, "low"), now=109.0)
    order = []
    for step in range(6):
        now = 109.0 + step * 0.1
        a.add("k", enqueued(now - 5.0, 9, f"h{step}"), now=now)
        queue, _ = a.pick(now)
        assert queue is not None
        order += a.take(queue, now).items()

    # Then the backlog goes first until its level, served since 109 s, ranks after the low
    # one's 100 s (109.1 - 9 > 100): the low one runs in the third batch, not after the
    # backlog
    assert order[:3] == ["h0", "h1", "low"]


def test_a_level_never_served_ranks_from_its_head_entry() -> None:
    # Given a key holding priority 0 enqueued at 100 s and priority 9 enqueued at 108.5 s
    a = Assembler(capacity=1, timeout=0.0, age_per_priority=1.0, unix_offset=0.0)
    a.add("k", enqueued(100.0, 0, "low"), now=109.0)
    a.add("k", enqueued(108.5, 9, "high"), now=109.0)
    a.add("k", enqueued(109.5, 9, "later"), now=109.0)

    # Then the one enqueued less than 9 s after the low one goes first, and once priority 9
    # was served at 109 s the low one follows
    taken = []
    for now in (109.0, 109.1, 109.2):
        queue, _ = a.pick(now)
        assert queue is not None
        taken += a.take(queue, now).items()
    assert taken == ["high", "low", "later"]


def flood(
    a: Assembler,
    batches: int,
    batch_s: float,
    low_every: int,
    lows: int,
    slow: tuple[int, float] = (0, 0.0),
) -> tuple[dict[str, int], int]:
    """``batches`` batches of ``batch_s`` each (``slow``: batch number, seconds more), a batch of
    priority-9 work added before each (enqueued 5 s earlier), and ``lows`` priority-0 requests
    added one every ``low_every`` batches: how many batches each low one waited, and how many
    were sent."""
    sent: dict[str, int] = {}
    waited: dict[str, int] = {}
    now = 100.0
    for step in range(batches):
        now += batch_s + (slow[1] if step == slow[0] else 0.0)
        for j in range(int(a.capacity)):
            a.add("k", enqueued(now - 5.0, 9, f"h{step}.{j}"), now=now)
        if step % low_every == 0 and len(sent) < lows:
            sent[f"low{step}"] = step
            a.add("k", enqueued(now, 0, f"low{step}"), now=now)
        queue, _ = a.pick(now)
        assert queue is not None
        for item in a.take(queue, now).items():
            if item in sent:
                waited[item] = step - sent[item]
    return waited, len(sent)


def test_every_low_priority_request_of_a_sparse_stream_runs_within_its_bound() -> None:
    # Given batches of one item every 0.1 s, a priority-9 flood that never ends, and a
    # priority-0 request every 2 s on the same key
    a = Assembler(capacity=1, timeout=0.0, age_per_priority=1.0, unix_offset=0.0)
    waited, _ = flood(a, batches=600, batch_s=0.1, low_every=20, lows=30)
    # Then each runs about 9 s (9 levels of 1 s: 90 batches) after it was sent, not one per
    # 9 s (the second 16 s, the third 23 s ... as when a batch's service restarted the
    # level's clock)
    assert len(waited) >= 25
    assert max(waited.values()) <= 92, sorted(waited.values())


def test_low_priority_requests_that_fell_behind_after_a_slow_batch_catch_up() -> None:
    # Given batches of 4 every 0.05 s, a priority-9 flood that never ends, ageing of 0.1 s per
    # level (9 levels: 18 batches), a priority-0 request every 2 batches, and one batch that
    # takes 0.3 s longer: the requests sent before it come due together
    a = Assembler(capacity=4, timeout=0.0, age_per_priority=0.1, unix_offset=0.0)
    waited, sent = flood(a, batches=120, batch_s=0.05, low_every=2, lows=30, slow=(20, 0.3))
    # Then each runs within the bound counted in batches from its send: those that fell behind
    # take turns with the flood until they caught up (when a batch restarted the level's clock
    # for a head already due, each waited a whole bound after the one before: 35, 52, 69 ...
    # batches, never catching up)
    assert len(waited) == sent
    assert max(waited.values()) <= 19, waited
