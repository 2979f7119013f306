"""A serving's max_latency, set at run time (`queueserve config set NAME max_latency=...`) or
in code (a keyword or a class attribute): the worker learns what its batches take and closes a
batch as soon as waiting longer would not help, or would push its oldest item past the target;
batch_timeout stays the upper bound. Checked by outcome, not by timing: with a batch_timeout of
an hour, a lone request is answered only if the plan closed its batch."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable

import pytest
import redis

import queueserve as qs
from tests.support.helpers import WAIT_S, wait_until
from tests.support.servings import Recording

StartWorker = Callable[..., qs.Worker]


@pytest.mark.timeout(120)
def test_with_max_latency_set_at_run_time_a_lone_request_does_not_wait_for_batch_timeout(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a worker whose batches wait up to an hour to fill, and a first batch run full
    serving = Recording(name="slow_fill", batch_size=4, batch_timeout="1h")
    worker = start_worker(serving, metrics_port=0)
    client = qs.Client(redis_url, prefix=prefix)
    assert client.dispatch_many("slow_fill", [1, 2, 3, 4]) == [1, 2, 3, 4]

    # When an operator sets a latency target
    caplog.set_level("INFO")
    redis_client.hset(f"{prefix}:{{slow_fill}}:config", "max_latency", "200ms")
    wait_until(lambda: "max_latency changed from 0.0 to 0.2" in caplog.text, "the target")

    # Then lone requests are answered (in batches of their own), not an hour later
    for i in range(3):
        assert client.submit("slow_fill", [f"lone{i}"]).result(WAIT_S) == [f"lone{i}"]
    assert serving.item_batches[-3:] == [["lone0"], ["lone1"], ["lone2"]]
    # and /metrics shows the learned batch time and the last batch's slack
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    labels = 'partition="0",serving="slow_fill"'
    assert re.search(rf'^queueserve_batch_model_seconds{{{labels},term="b"}} \S+$', text, re.M)
    assert re.search(rf"^queueserve_latency_slack_seconds{{{labels}}} \S+$", text, re.M)

    # And once it is unset, batches wait for batch_timeout again
    redis_client.hset(f"{prefix}:{{slow_fill}}:config", "max_latency", "0")
    wait_until(lambda: "max_latency changed from 0.2 to 0.0" in caplog.text, "no target")
    waiting = client.submit("slow_fill", ["waits"])
    assert client.dispatch_many("slow_fill", [1, 2, 3]) == [1, 2, 3]
    assert waiting.result(WAIT_S) == ["waits"]  # it ran in the full batch, with those three
    assert sorted(map(str, serving.item_batches[-1])) == ["1", "2", "3", "waits"]
    client.close()


class LatencyTarget(Recording):
    """max_latency as a class attribute, as a subclass may set any option."""

    max_latency = "200ms"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["keyword", "class attribute"])
def test_max_latency_set_in_code_closes_batches_as_config_set_does(
    start_worker: StartWorker, redis_url: str, prefix: str, how: str
) -> None:
    # Given a serving whose batches wait up to an hour to fill, with a target set in code
    if how == "keyword":
        serving = Recording(name="in_code", batch_size=4, batch_timeout="1h", max_latency="200ms")
    else:
        serving = LatencyTarget(name="in_code", batch_size=4, batch_timeout="1h")
    assert serving.max_latency == 0.2
    start_worker(serving)
    # When lone requests come, no config hash written by anyone
    with qs.Client(redis_url, prefix=prefix) as client:
        # Then each is answered in a batch of its own, not an hour later
        for i in range(3):
            assert client.submit("in_code", [f"lone{i}"]).result(WAIT_S) == [f"lone{i}"]
    assert serving.item_batches == [["lone0"], ["lone1"], ["lone2"]]
