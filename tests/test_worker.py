"""The in-process worker (``Worker.start()``): what setup() prepares is what serves."""

from __future__ import annotations

from typing import Any

import queueserve as qs


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
            [101, "cpu"], [102, "cpu"], [103, "cpu"], [104, "cpu"], [105, "cpu"]
        ]
    assert Stateful.setups == 1
