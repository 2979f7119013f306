"""How a client spreads a sharded serving's requests over its shards (docs/scaling.md,
"Shards"): by items sent, shared by every call of the client, without a round trip; a small
send in one script call, a large one split over the shards."""

from __future__ import annotations

from typing import Any

import queueserve as qs
from queueserve.client.core import ClientCore
from queueserve.client.outgoing import Outgoing, enqueue_groups
from queueserve.client.targets import SPLIT_SEND_ABOVE, plan


def noop(xs: list[Any]) -> list[Any]:
    return xs


def _base() -> ClientCore:
    return ClientCore("redis://localhost:6379/0", "qsu")


def _send(base: ClientCore, serving: qs.Serving, sizes: list[int]) -> list[Outgoing]:
    """One send: a request of ``n`` items per size, each through its own Target (as calls
    passing the Serving object make them)."""
    batch = []
    for n in sizes:
        target = base.targets.remember(serving, {})
        batch.append(base.request(target, plan(target, list(range(n)), None)[0], None))
    return batch


def test_a_few_large_sends_still_give_each_shard_a_third_of_the_items() -> None:
    # Given a client and a 3-shard serving, and a short run: 5 sends of 1 to 900 one-item
    # requests (a send carries whatever the callers queued meanwhile)
    base = _base()
    serving = qs.Serving(noop, name="spread", shards=3)
    per_shard = [0, 0, 0]
    for requests in (900, 1, 512, 3, 700):
        # When each send is placed
        for _, shard, reqs, _, _, _ in enqueue_groups(_send(base, serving, [1] * requests)):
            per_shard[shard.shard] += len(reqs)
    # Then the shards' items are within 20% of each other (one shard per send: 900 vs 4)
    assert min(per_shard) >= 0.8 * max(per_shard), per_shard


def test_a_small_send_is_one_script_call_on_the_emptiest_shard() -> None:
    base = _base()
    serving = qs.Serving(noop, name="small", shards=3)
    groups = list(enqueue_groups(_send(base, serving, [40, 40, 40])))
    assert sum(n for n in (40, 40, 40)) <= SPLIT_SEND_ABOVE
    assert len(groups) == 1 and len(groups[0][2]) == 3
    first = groups[0][1].shard
    # the next small sends go to the other two shards, which hold fewer items
    shards = [next(enqueue_groups(_send(base, serving, [10])))[1].shard for _ in range(4)]
    assert sorted([first, *shards[:2]]) == [0, 1, 2] and first not in shards
    # a large send is split: one script call per shard, each call's requests on its shard
    split = list(enqueue_groups(_send(base, serving, [50] * 6)))
    assert sorted(s.shard for _, s, _, _, _, _ in split) == [0, 1, 2]
    assert all(call.keys is shard for outs, shard, *_ in split for _, _, call, _, _ in outs)


def test_the_requests_of_one_call_go_to_one_shard_marked_to_be_admitted_together() -> None:
    # Given one send: a lone request, a call cut into 6 requests of 50, another lone request
    base = _base()
    serving = qs.Serving(noop, name="together", shards=3)
    target = base.targets.remember(serving, {})
    parts = [plan(target, list(range(n)), None)[0] for n in (50, 50, 50, 50, 50, 50)]
    cut = base.requests(target, parts, None, 0)
    batch = [*_send(base, serving, [50]), *cut, *_send(base, serving, [50])]

    # When it is placed (large: spread over the shards)
    groups = list(enqueue_groups(batch))

    # Then the call's six requests went to one shard as one run, admitted together (max_queue
    # counts per shard: spread, a call could be admitted on one and refused on another) ...
    (outs, _, _, _, _, together), *others = sorted(groups, key=lambda g: -len(g[5]))
    ours = [i for i, o in enumerate(outs) if o.call.group]
    assert len(ours) == 6 and together == [(ours[0], 6)]
    assert {o.call.group for o in cut} == {cut[0].call.rid}
    # ... the lone requests in no run, and the send still spread over the shards
    assert all(g[5] == [] for g in others) and len(groups) > 1


def test_every_call_with_the_serving_object_shares_one_spread() -> None:
    base = _base()
    serving = qs.Serving(noop, name="shared", shards=3)
    first, second = base.targets.remember(serving, {}), base.targets.remember(serving, {})
    assert first is not second and first.spread is second.spread
    # a serving named by a caller and told its shard count by the workers (on shard 0 and,
    # to confirm it, on the last shard)
    meta = {"codec": "msgpack", "shards": "2"}
    last = base.targets.last_shard(base.targets.keys_of("named"), meta)
    assert last is not None and last.shard == 1
    assert base.targets.remember("unconfirmed", meta, {}).shards[1:] == []
    named = base.targets.remember("named", meta, {"shards": "2"})
    assert sorted(k.shard for _ in range(2) for k in named.place([1])) == [0, 1]
    assert named.spread is not None and named.spread.sent == [1, 1]
