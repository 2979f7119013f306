"""The in-process worker (``Worker.start()``): what setup() prepares is what serves."""

from __future__ import annotations

from typing import Any

import redis

import queueserve as qs
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import GROUP, Keys, inbox_key
from queueserve.wire.request import encode_request


class Stateful(qs.Serving):
    """Loads its 'model' in setup(), as real servings do."""

    name = "stateful"
    batch_size = 4
    batch_timeout = 0.0
    setups = 0

    def setup(self, partition: qs.Partition) -> None:
        type(self).setups += 1
        self.offset = 100
        self.device = partition.device

    def handle_batch(self, batch: qs.Batch) -> list[Any]:
        return [(x + self.offset, self.device) for x in batch]


def test_state_loaded_in_setup_serves_batches(
    redis_url: str, prefix: str, client: qs.Client
) -> None:
    serving = Stateful()
    Stateful.setups = 0
    with qs.Worker(serving, redis_url=redis_url, prefix=prefix, handle_signals=False):
        assert client.dispatch_many("stateful", [1, 2, 3, 4, 5]) == [
            [101, "cpu"],
            [102, "cpu"],
            [103, "cpu"],
            [104, "cpu"],
            [105, "cpu"],
        ]
    assert Stateful.setups == 1


def test_entries_pending_for_a_live_worker_without_its_knowing_are_served(
    redis_url: str, prefix: str, client: qs.Client, redis_client: redis.Redis
) -> None:
    # Given a running worker
    serving = Stateful()
    with qs.Worker(serving, redis_url=redis_url, prefix=prefix, handle_signals=False) as worker:
        assert client.dispatch("stateful", 1) == [101, "cpu"]
        consumer = worker._host.consumer  # type: ignore[union-attr]
        keys = Keys(prefix, "stateful")

        # When a request becomes pending for it behind its back (as when a Redis restart that
        # lost its last second of writes brings back a delivery the worker never saw): added
        # and delivered in one transaction, so the worker's own read never sees it
        call = client._table.new(1, keys, "default")
        header, payload = encode_request(
            get_codec("msgpack"), call.rid, [2], inbox_key(prefix, client.client_id), None
        )
        pipe = redis_client.pipeline(transaction=True)
        pipe.xadd(keys.stream("default"), {"h": header, "p": payload, "a": 1})
        pipe.incr(keys.queued)
        pipe.xreadgroup(GROUP, consumer, {keys.stream("default"): ">"}, count=10)
        delivered = pipe.execute()[2]
        assert len(delivered[0][1]) == 1

        # Then the worker finds it among its pending entries and answers it
        assert call.wait(30) and call.results == [[102, "cpu"]]
    assert redis_client.xlen(keys.stream("default")) == 0
