"""The option-effect table (the fuzz table's twin): every serving option, set each way the docs
allow, acts through a real worker, observed from the public API.

A serving option is set as a ``qs.Serving`` keyword, as a class attribute of a subclass, and,
for the run-time ones (``RUNTIME``), with ``queueserve config set`` while the worker runs. Each
row of ``EFFECTS`` sets one option to a value other than its default and checks what a user
would see: a batch size that bounds batches, a timeout that holds a lone item, a queue limit
that refuses the next call... A row either carries its check here (``Effect``) or names the
tests that observe the option set those ways (``Proven``, where the effect needs what a test
of its own already builds: killed workers, weights counted over backlogs). An option without a
row fails ``test_every_serving_option_has_a_row_for_each_way_it_can_be_set``, as a key without
a fuzz entry fails tests/unit/test_fuzz_registry.py. The worker's own options have theirs in
tests/integration/test_worker_option_effects.py.
"""

from __future__ import annotations

import hashlib
import logging
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import redis

import queueserve as qs
from queueserve.broker import common, replies
from queueserve.options.serving_options import RUNTIME, ServingOptions
from queueserve.wire.keys import GROUP, Keys
from tests.support.helpers import (
    REPO,
    WAIT_S,
    child_env,
    items_waiting,
    wait_until,
)
from tests.support.servings import Recording

StartWorker = Callable[..., qs.Worker]
NAME = "opt"
WAYS = ("keyword", "class attribute", "config set")


@dataclass
class Context:
    """What a check sees: the serving as set, its worker, a client, the test's Redis."""

    serving: Recording
    worker: qs.Worker
    client: qs.Client
    redis: redis.Redis
    url: str
    prefix: str
    start_again: Callable[[], qs.Worker]

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix, NAME)


@dataclass(frozen=True)
class Effect:
    """Set the option to ``value`` (``text`` for ``config set``); ``check`` sees the effect.
    ``base``: other options the check needs; ``fn``: the batch function (echo by default)."""

    value: Any
    text: str
    check: Callable[[Context], None]
    base: dict[str, Any] = field(default_factory=dict)
    fn: Callable[[list[Any]], Any] | None = None
    serving_class: type[Recording] = Recording
    ways: tuple[str, ...] = WAYS


@dataclass(frozen=True)
class Proven:
    """The tests (``path::name``, one per way) that set the option each way and observe it."""

    by_way: dict[str, str]


def submit_result(ctx: Context, items: list[Any], **kw: Any) -> Any:
    return ctx.client.submit(NAME, items, **kw).result(WAIT_S)


# --- the checks ------------------------------------------------------------------------------


def batches_of_at_most_3(ctx: Context) -> None:
    assert submit_result(ctx, list(range(7))) == list(range(7))
    assert [len(b) for b in ctx.serving.item_batches] == [3, 3, 1]  # 32 by default: [7]


def redis_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return int(seconds) * 1000 + int(micros) // 1000


def a_lone_item_waits_for_the_batch_to_fill(ctx: Context) -> None:
    first = ctx.client.submit(NAME, ["a"])
    wait_until(lambda: items_waiting(ctx.worker) == 1 or ctx.serving.batches, "'a' read")
    read = redis_ms(ctx.redis)  # 10 times the default timeout, nothing to an hour
    wait_until(lambda: redis_ms(ctx.redis) >= read + 100, "100 ms on Redis's clock")
    rest = ctx.client.submit(NAME, ["b", "c", "d"])
    assert first.result(WAIT_S) == ["a"] and rest.result(WAIT_S) == ["b", "c", "d"]
    assert ctx.serving.item_batches == [["a", "b", "c", "d"]]  # 10 ms by default: ["a"] alone


def the_third_waiting_item_is_refused(ctx: Context) -> None:
    running = ctx.client.submit(NAME, ["r"])
    wait_until(lambda: len(ctx.serving.batches) == 1, "a batch held in the executor")
    kept = ctx.client.submit(NAME, ["q1"])  # 2 items admitted: the running one and this
    with pytest.raises(qs.QueueFull):
        ctx.client.submit(NAME, ["q2"]).result(WAIT_S)
    ctx.serving.release()
    assert running.result(WAIT_S) == ["r"] and kept.result(WAIT_S) == ["q1"]


def pickle_carries_what_msgpack_cannot(ctx: Context) -> None:
    with qs.Client(ctx.url, prefix=ctx.prefix, codec="pickle") as trusting:
        assert trusting.dispatch(NAME, frozenset({1, 2}), timeout=WAIT_S) == frozenset({1, 2})


def fails_on_x(items: list[Any]) -> list[Any]:
    if "x" in items:
        raise ValueError("no x")
    return items


def one_bad_item_fails_the_whole_batch(ctx: Context) -> None:
    ctx.serving.hold()
    held = ctx.client.submit(NAME, ["held"])
    wait_until(lambda: len(ctx.serving.batches) == 1, "a batch held in the executor")
    good, bad = ctx.client.submit(NAME, [1]), ctx.client.submit(NAME, ["x"])
    wait_until(lambda: items_waiting(ctx.worker) == 2, "both read into one batch")
    ctx.serving.release()
    assert held.result(WAIT_S) == ["held"]
    for ticket in (good, bad):  # "isolate" (the default) answers [1]
        with pytest.raises(qs.RemoteError, match="no x"):
            ticket.result(WAIT_S)


def a_request_delivered_twice_is_dead_lettered(ctx: Context) -> None:
    # The worker stops; a request waits; a consumer that then dies (never heartbeats) reads
    # it: one delivery. The next worker reclaims it: a second, over max_deliveries=1.
    ctx.worker.stop(timeout=10)
    ticket = ctx.client.submit(NAME, ["twice"])
    stream = ctx.keys.stream("default")
    wait_until(lambda: ctx.redis.xlen(stream) == 1, "the request queued")
    ctx.redis.xreadgroup(GROUP, "ghost", {stream: ">"}, count=1)
    ctx.start_again()
    with pytest.raises(qs.DeadLettered):  # 3 by default: it runs
        ticket.result(WAIT_S)


def a_payload_over_100_bytes_is_refused_before_sending(ctx: Context) -> None:
    with pytest.raises(qs.BadRequest, match="over max_payload_bytes=100"):
        ctx.client.dispatch(NAME, "x" * 1000, timeout=WAIT_S)
    assert ctx.client.dispatch(NAME, "small", timeout=WAIT_S) == "small"


def a_result_over_1024_bytes_fails_alone(ctx: Context) -> None:
    got = ctx.client.dispatch_many(NAME, ["y" * 5000, "ok"], return_exceptions=True)
    assert isinstance(got[0], qs.RemoteError) and "max_reply_bytes=1024" in str(got[0])
    assert got[1] == "ok"


def an_idle_key_is_forgotten(ctx: Context) -> None:
    assert submit_result(ctx, ["k"], batch_key="idle") == ["k"]
    wait_until(lambda: ctx.redis.zscore(ctx.keys.seen, "idle") is None, "key forgotten")
    assert not ctx.redis.exists(ctx.keys.stream("idle"))  # an hour by default


def requests_spread_over_3_hash_tags(ctx: Context) -> None:
    for i in range(12):
        assert submit_result(ctx, [i], batch_key=f"k{i}") == [i]
    tags = {
        m.group(1)
        for k in ctx.redis.scan_iter(match=f"{ctx.prefix}:{{{NAME}*", count=1000)
        if (m := re.match(rf"{re.escape(ctx.prefix)}:\{{([^}}]*)\}}:in:", k.decode()))
    }
    assert len(tags) == 3, tags  # one by default


def an_unanswered_call_is_told_no_replica_holds_it(ctx: Context) -> None:
    ctx.serving.hold()  # no answer comes before the wait for a replica ends
    ticket = ctx.client.submit(NAME, ["kept"])
    with pytest.raises(qs.NotReplicated):  # not durable: it would wait for its answer
        ticket.result(WAIT_S)
    ctx.serving.release()


class TwoAtOnce(Recording):
    """prepare_batch returns only once two batches are preparing at the same time."""

    both = threading.Barrier(2, timeout=WAIT_S / 4)

    def prepare_batch(self, batch: qs.Batch) -> Any:
        self.both.wait()
        return list(batch)


def two_batches_prepare_at_once(ctx: Context) -> None:
    TwoAtOnce.both.reset()
    a = ctx.client.submit(NAME, ["a"], batch_key="a")
    b = ctx.client.submit(NAME, ["b"], batch_key="b")
    assert a.result(WAIT_S) == ["a"] and b.result(WAIT_S) == ["b"]  # 1 by default: broken


def a_low_priority_that_waited_300ms_goes_first(ctx: Context) -> None:
    # At 100 ms a level, 300 ms of waiting is worth more than 1 level (1 s by default): in the
    # batch of two that low and high make, low's item comes first
    held = ctx.client.submit(NAME, ["held", "held"])
    wait_until(lambda: len(ctx.serving.batches) == 1, "a batch held in the executor")
    low = ctx.client.submit(NAME, ["low"])
    wait_until(lambda: items_waiting(ctx.worker) == 1, "low read")
    sent = redis_ms(ctx.redis)
    wait_until(lambda: redis_ms(ctx.redis) >= sent + 300, "300 ms on Redis's clock")
    high = ctx.client.submit(NAME, ["high"], priority=1)
    ctx.serving.release()
    for ticket in (held, low, high):
        ticket.result(WAIT_S)
    assert ctx.serving.item_batches[1] == ["low", "high"]


def a_key_runs_again_once_its_record_expired(ctx: Context) -> None:
    assert submit_result(ctx, ["i"], idempotency_key="ttl") == ["i"]
    wait_until(lambda: not ctx.redis.exists(ctx.keys.once("ttl")), "the key's record expired")
    assert submit_result(ctx, ["i"], idempotency_key="ttl") == ["i"]
    assert ctx.serving.item_batches == [["i"], ["i"]]  # 24 h by default: it runs once


def a_repeat_is_answered_from_the_cache(ctx: Context) -> None:
    assert submit_result(ctx, ["c"]) == ["c"]
    entry = cached_entry(ctx, "c")
    wait_until(lambda: ctx.redis.exists(entry), "c's result cached")
    assert submit_result(ctx, ["c"]) == ["c"]
    assert ctx.serving.item_batches == [["c"]]  # 0 (off) by default: it runs twice


def cached_entry(ctx: Context, item: Any, version: str = "") -> str:
    """The documented entry name (wire/cache.py): BLAKE2b-128 of version, key and payload."""
    h = hashlib.blake2b(version.encode(), digest_size=16)
    for part in (b"\0", b"default", b"\0", msgpack.packb([item])):
        h.update(part)
    return ctx.keys.cached(h.hexdigest())


def results_are_cached_under_version_v7(ctx: Context) -> None:
    assert submit_result(ctx, ["v"]) == ["v"]
    wait_until(lambda: ctx.redis.exists(cached_entry(ctx, "v", "v7")), "cached under v7")
    assert not ctx.redis.exists(cached_entry(ctx, "v"))  # "" by default
    assert submit_result(ctx, ["v"]) == ["v"] and ctx.serving.item_batches == [["v"]]


def a_result_over_100_bytes_is_not_cached(ctx: Context) -> None:
    big = "b" * 200
    for _ in range(2):
        assert submit_result(ctx, [big, "s"]) == [big, "s"]
        wait_until(lambda: ctx.redis.exists(cached_entry(ctx, "s")), "the small one cached")
    assert not ctx.redis.exists(cached_entry(ctx, big))  # 1 MiB by default: cached
    assert sorted(x for b in ctx.serving.item_batches for x in b) == [big, big, "s"]


EFFECTS: dict[str, Effect | Proven] = {
    "batch_size": Effect(3, "3", batches_of_at_most_3),
    "batch_timeout": Effect("1h", "1h", a_lone_item_waits_for_the_batch_to_fill, {"batch_size": 4}),
    "max_queue": Effect(2, "2", the_third_waiting_item_is_refused, {"gated": True}),
    "codec": Effect("pickle", "pickle", pickle_carries_what_msgpack_cannot),
    "on_error": Effect("fail", "fail", one_bad_item_fails_the_whole_batch, fn=fails_on_x),
    "max_deliveries": Effect(1, "1", a_request_delivered_twice_is_dead_lettered),
    "max_payload_bytes": Effect(100, "100", a_payload_over_100_bytes_is_refused_before_sending),
    "max_reply_bytes": Effect(1024, "1024", a_result_over_1024_bytes_fails_alone),
    "key_idle_ttl": Effect("200ms", "200ms", an_idle_key_is_forgotten),
    "shards": Effect(3, "3", requests_spread_over_3_hash_tags),
    "durable": Effect(True, "true", an_unanswered_call_is_told_no_replica_holds_it),
    "prepare_concurrency": Effect(
        2, "2", two_batches_prepare_at_once, serving_class=TwoAtOnce, base={"batch_size": 1}
    ),
    "priority_age": Effect(
        "100ms",
        "100ms",
        a_low_priority_that_waited_300ms_goes_first,
        {"batch_size": 2, "batch_timeout": "1h", "gated": True},
    ),
    "idempotency_ttl": Effect("300ms", "300ms", a_key_runs_again_once_its_record_expired),
    "cache_ttl": Effect("10m", "10m", a_repeat_is_answered_from_the_cache),
    "cache_version": Effect("v7", "v7", results_are_cached_under_version_v7, {"cache_ttl": "10m"}),
    "cache_max_bytes": Effect(
        100, "100", a_result_over_100_bytes_is_not_cached, {"cache_ttl": "10m"}
    ),
    "batch_key_weights": Proven(
        {
            way: "tests/integration/test_weights.py::"
            "test_a_weight_4_key_gets_about_4_times_the_batches_of_a_weight_1_key"
            for way in WAYS
        }
    ),
    "max_latency": Proven(
        {
            "keyword": "tests/integration/test_max_latency.py::"
            "test_max_latency_set_in_code_closes_batches_as_config_set_does",
            "class attribute": "tests/integration/test_max_latency.py::"
            "test_max_latency_set_in_code_closes_batches_as_config_set_does",
            "config set": "tests/integration/test_max_latency.py::"
            "test_with_max_latency_set_at_run_time_a_lone_request_does_not_wait_for_batch_timeout",
        }
    ),
    "max_loaded_keys": Proven(
        {
            way: "tests/integration/test_key_states.py::"
            "test_results_come_from_their_keys_state_and_at_most_max_loaded_keys_are_held"
            for way in WAYS[:2]
        }
    ),
    "max_loaded_bytes": Proven(
        {
            way: "tests/integration/test_key_states.py::"
            "test_the_states_held_never_pass_max_loaded_bytes"
            for way in WAYS[:2]
        }
    ),
}


def ways_of(option: str) -> tuple[str, ...]:
    return WAYS if option in RUNTIME else WAYS[:2]


CASES = [
    pytest.param(option, way, id=f"{option}-{way.replace(' ', '_')}")
    for option, row in EFFECTS.items()
    if isinstance(row, Effect)
    for way in ways_of(option)
]


def test_every_serving_option_has_a_row_for_each_way_it_can_be_set() -> None:
    assert set(EFFECTS) == set(ServingOptions.model_fields), (
        "a serving option without a row in the option-effect table (or a row for none): add "
        f"one to EFFECTS: {set(ServingOptions.model_fields) ^ set(EFFECTS)}"
    )
    for option, row in EFFECTS.items():
        if isinstance(row, Proven):
            assert set(row.by_way) == set(ways_of(option)), option
            for way, test in row.by_way.items():
                path, _, name = test.partition("::")
                source = (REPO / path).read_text()
                assert f"def {name}(" in source, (option, way, test)
                assert option in source, (option, way, test)


@pytest.fixture
def quick_durable(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (common, replies):
        monkeypatch.setattr(module, "DURABLE_WAIT_MS", 300)


def config_set(url: str, prefix: str, assignment: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "queueserve", "config", "set", NAME, assignment,
         "--redis-url", url, "--prefix", prefix],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("option", "way"), CASES)
def test_the_option_acts_however_it_is_set(
    option: str,
    way: str,
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
    quick_durable: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a serving with the option set that way (its other options as the check needs)
    row = EFFECTS[option]
    assert isinstance(row, Effect)
    options: dict[str, Any] = {"name": NAME, "batch_timeout": "10ms", **row.base}
    gated = options.pop("gated", False)
    cls = row.serving_class
    if way == "keyword":
        options[option] = row.value
    elif way == "class attribute":  # a keyword would win over it
        options.pop(option, None)
        cls = type(f"With_{option}", (cls,), {option: row.value})
    serving = cls(row.fn, gated=gated, **options)
    worker = start_worker(serving)
    if way == "config set":
        caplog.set_level("INFO")
        config_set(redis_url, prefix, f"{option}={row.text}")
        wait_until(lambda: f"{option} changed from" in caplog.text, f"{option} applied")
        # a documented operator action is logged as news, never as a warning about itself
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    # When a client calls it, then what a user sees shows the option acting
    with qs.Client(redis_url, prefix=prefix) as client:
        ctx = Context(
            serving, worker, client, redis_client, redis_url, prefix, lambda: start_worker(serving)
        )
        row.check(ctx)
