"""How a client spreads a sharded serving's requests over its shards (docs/scaling.md,
"Shards"): by items sent, shared by every call of the client, without a round trip."""

from __future__ import annotations

from typing import Any

import queueserve as qs
from queueserve.client.base import ClientBase, enqueue_groups


def noop(xs: list[Any]) -> list[Any]:
    return xs


def _base() -> ClientBase:
    return ClientBase("redis://localhost:6379/0", "qsu")


def test_sends_of_uneven_size_still_give_each_shard_a_third_of_the_items() -> None:
    # Given a client and a 3-shard serving, and sends of 1 to 300 requests (a send carries
    # whatever its callers queued meanwhile)
    base = _base()
    serving = qs.Serving(noop, name="spread", shards=3)
    per_shard = [0, 0, 0]
    for size in [300, 1, 1, 200, 5, 90, 1, 300, 40, 2, 150, 7] * 5:
        # When each send picks its shard (a new Target per call, as with a Serving object)
        target = base.remember(serving, {})
        shard = target.next_shard(size)
        per_shard[shard.shard] += size
    # Then the shards' items differ by less than one large send, far within 20%
    assert max(per_shard) - min(per_shard) <= 300, per_shard
    assert min(per_shard) >= 0.8 * max(per_shard), per_shard


def test_every_call_with_the_serving_object_shares_one_spread() -> None:
    base = _base()
    serving = qs.Serving(noop, name="shared", shards=3)
    first, second = base.remember(serving, {}), base.remember(serving, {})
    assert first is not second and first.spread is second.spread
    # one-item sends take the shards in turn, whichever target they go through
    shards = [base.remember(serving, {}).next_shard(1).shard for _ in range(6)]
    assert sorted(shards[:3]) == [0, 1, 2] and shards[3:] == shards[:3]
    # a serving named by a caller and told its shard count by the workers
    named = base.remember("named", {"codec": "msgpack", "shards": "2"})
    assert [named.next_shard(1).shard for _ in range(4)].count(0) == 2


def test_a_send_counts_the_items_of_all_its_requests() -> None:
    base = _base()
    serving = qs.Serving(noop, name="counted", shards=2)
    target = base.remember(serving, {})
    batch = []
    for n in (3, 4):
        part = ClientBase.plan(target, list(range(n)), None)[0]
        batch.append(base.request(target, part, None))
    [(group, shard, requests, _, _)] = list(enqueue_groups(batch))
    assert len(group) == 2 and len(requests) == 2
    assert target.spread is not None and target.spread.sent[shard.shard] == 7
    assert sorted(target.spread.sent) == [0, 7]
