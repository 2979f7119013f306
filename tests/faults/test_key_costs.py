"""What a worker spends grows with the keys that have work, not with every key ever seen
(docs/guarantees.md, "Idle keys and metrics cost nothing"): the sweep looks at a bounded slice
of the known keys per call, and the metrics endpoint labels a bounded set of keys, listens on
127.0.0.1 unless told otherwise, and keeps no thread for a silent connection.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import redis

import queueserve as qs
from queueserve.broker.reads import SWEEP_KEYS
from queueserve.ops.cli import main as cli_main
from queueserve.wire.keys import GROUP, Keys
from queueserve.wire.priority import MAX_PRIORITY
from queueserve.worker.metrics_server import MAX_CONNECTIONS
from tests.support.fault_app import RawInbox, header
from tests.support.helpers import wait_until
from tests.support.redis_server import RedisServer
from tests.support.servings import Recording

WAIT_S = 60.0


def echo(name: str, **options: Any) -> qs.Serving:
    return qs.Serving(lambda xs: list(xs), name=name, batch_size=8, batch_timeout=0, **options)


def seed_idle_keys(r: redis.Redis, keys: Keys, count: int, last_ms: int) -> list[str]:
    """``count`` batch keys as a served-and-answered request leaves them: known in ``seen``
    (last enqueued about ``last_ms``, unix ms), an empty stream with its consumer group,
    nothing ready, active or queued."""
    names = [f"idle{i:06d}" for i in range(count)]
    pipe = r.pipeline(transaction=False)
    for i, name in enumerate(names):
        pipe.zadd(keys.seen, {name: last_ms + i})
        pipe.xgroup_create(keys.stream(name), GROUP, "0", mkstream=True)
    pipe.execute()
    return names


def now_ms() -> int:
    return int(time.time() * 1000)


def command_calls(r: redis.Redis, command: str) -> int:
    """How often Redis ran ``command`` since the last CONFIG RESETSTAT (scripts' calls too)."""
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.fixture
def private_redis(redis_tmp_server: RedisServer) -> Iterator[redis.Redis]:
    """A server of this test's own: its command counters count this worker alone."""
    r = redis.Redis.from_url(redis_tmp_server.url)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def served(redis_tmp_server: RedisServer, prefix: str) -> Iterator[Any]:
    """``served(*servings, **worker_options)``: a worker and a client on the private server."""
    made: list[Any] = []

    def start(*servings: qs.Serving, **options: Any) -> tuple[qs.Worker, qs.Client]:
        worker = qs.Worker(
            list(servings),
            redis_url=redis_tmp_server.url,
            prefix=prefix,
            handle_signals=False,
            shutdown_timeout=10.0,
            **options,
        ).start()
        client = qs.Client(redis_tmp_server.url, prefix=prefix)
        made.extend([client, worker])
        return worker, client

    yield start
    for thing in made:
        if isinstance(thing, qs.Client):
            thing.close()
        else:
            for serving in thing.servings:
                gate = getattr(serving, "gate", None)
                if gate is not None:
                    gate.set()
            thing.stop(timeout=10.0)


# --- the sweep --------------------------------------------------------------------------------
def test_a_sweep_over_20000_idle_keys_looks_at_a_bounded_slice_of_them(
    private_redis: redis.Redis,
    served: Any,
    prefix: str,
) -> None:
    # Given 20,000 known idle batch keys and a worker serving them
    keys = Keys(prefix, "idle")
    seed_idle_keys(private_redis, keys, 20_000, now_ms())
    _, client = served(echo("idle"))
    assert client.dispatch("idle", 1, timeout=WAIT_S) == 1

    # When the worker sweeps three times (each sweep takes a stale stream out of the active
    # set: that is how the test sees one happen)
    private_redis.config_resetstat()
    marker = keys.stream("marker")
    for _ in range(3):
        private_redis.zadd(keys.active, {marker: 0})
        wait_until(lambda: private_redis.zscore(keys.active, marker) is None, "a sweep")

    # Then those sweeps looked at a bounded slice of the keys (each one XLEN per priority of
    # SWEEP_KEYS keys and the declared one; room is left for a few more sweeps on a slow
    # machine), not at all 20,000 (one such sweep is 200,000 XLENs)
    looks = command_calls(private_redis, "xlen")
    assert 0 < looks <= 10 * (SWEEP_KEYS + 1) * (MAX_PRIORITY + 1), looks


def test_an_entry_written_without_enqueue_to_a_known_idle_key_is_found_by_the_pass(
    private_redis: redis.Redis,
    served: Any,
    prefix: str,
) -> None:
    # Given 3 x SWEEP_KEYS known idle keys, and a worker serving them
    keys = Keys(prefix, "plain")
    names = seed_idle_keys(private_redis, keys, 3 * SWEEP_KEYS, now_ms())
    _, client = served(echo("plain"))
    assert client.dispatch("plain", 1, timeout=WAIT_S) == 1

    # When entries are XADDed (no enqueue.lua: nothing marks them ready) to the first, a
    # middle and the last of them
    inbox = RawInbox(private_redis, prefix)
    for rid, name in enumerate((names[0], names[len(names) // 2], names[-1])):
        private_redis.xadd(
            keys.stream(name), {"h": header(rid, 1, inbox.key), "p": msgpack.packb([name])}
        )

    # Then the sweep's pass over the keys finds and serves every one
    wait_until(lambda: inbox.answered([0, 1, 2]), "answers to the plain XADDs")
    assert [inbox.error_kind(rid) for rid in range(3)] == [None, None, None]


def test_idle_keys_are_forgotten_a_slice_at_a_time_and_a_forgotten_key_serves_again(
    private_redis: redis.Redis,
    served: Any,
    prefix: str,
) -> None:
    # Given 2 x SWEEP_KEYS + 1 keys idle for long, and a serving that forgets keys idle 1 s
    keys = Keys(prefix, "forget")
    seed_idle_keys(private_redis, keys, 2 * SWEEP_KEYS + 1, now_ms() - 3_600_000)
    _, client = served(echo("forget", key_idle_ttl="1s"))

    # When the worker sweeps: every one is forgotten, streams and all (not the declared one)
    wait_until(lambda: private_redis.zcard(keys.seen) == 0, "the idle keys forgotten")
    assert not private_redis.exists(keys.stream("idle000000"), keys.stream("idle000400"))

    # Then a request on a forgotten key brings it back
    assert client.dispatch("forget", "back", batch_key="idle000007", timeout=WAIT_S) == "back"


def test_stats_over_20000_idle_keys_read_the_keys_with_work_and_the_latest_idle_ones(
    private_redis: redis.Redis,
    redis_tmp_server: RedisServer,
    prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given 20,000 known idle keys and one request waiting on key "busy" (no worker runs; the
    # serving declared as a worker would)
    keys = Keys(prefix, "st")
    private_redis.hset(keys.meta, "codec", "msgpack")
    private_redis.zadd(keys.servings, {"st": now_ms()})
    seed_idle_keys(private_redis, keys, 20_000, now_ms() - 60_000)
    with qs.Client(redis_tmp_server.url, prefix=prefix) as client:
        client.submit("st", [1, 2], batch_key="busy")
        wait_until(lambda: private_redis.xlen(keys.stream("busy")) == 1, "the request queued")

    # When an operator runs queueserve stats
    private_redis.config_resetstat()
    assert (
        cli_main(
            [
                "stats",
                "st",
                "--redis-url",
                redis_tmp_server.url,
                "--prefix",
                prefix,
                "--interval",
                "10ms",
            ]
        )
        == 0
    )

    # Then it shows the busy key and the 19 idle keys enqueued to last, counts the others, and
    # read the streams of those 20 keys alone (twice: before and after its interval), not of
    # all 20,001 (400,020 XINFO GROUPS calls before)
    by_key, by_priority = capsys.readouterr().out.split("\n\n")  # two tables
    lines = by_key.splitlines()
    rows = {line.split()[1]: line.split() for line in lines[1:] if "..." not in line}
    assert rows["busy"][2:4] == ["2", "1"]  # items queued, entries waiting
    assert len(rows) == 20 and "idle019999" in rows and "idle019980" not in rows
    assert "and 19981 more known batch keys, idle (not shown)" in lines[-1]
    assert by_priority.splitlines()[1].split()[:3] == ["st", "0", "2"]  # priority 0: 2 items
    looks = command_calls(private_redis, "xinfo|groups")
    assert 0 < looks <= 2 * 20 * (MAX_PRIORITY + 1), looks


# --- metrics ----------------------------------------------------------------------------------
def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def _samples(text: str, name: str, serving: str) -> dict[str, float]:
    """``{key label: value}`` of one metric of one serving."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and f'serving="{serving}"' in line:
            labels, value = line.rsplit(" ", 1)
            key = labels.split('key="', 1)[1].split('"', 1)[0]
            out[key] = float(value)
    return out


def test_metrics_label_the_deepest_keys_and_sum_the_rest_under_other(
    served: Any,
    prefix: str,
) -> None:
    # Given a worker labelling 3 keys besides the declared ones, whose executor is held, and
    # 2 to 21 requests waiting on each of 20 keys (batch_size 1: one entry each, no packs)
    serving = Recording(name="labels", batch_size=1, batch_timeout=0, gated=True)
    worker, client = served(serving, metrics_port=0, metrics_keys=3)
    blocker = client.submit(serving, ["blocker"])
    wait_until(lambda: serving.batches, "the blocker batch to start")
    tickets = [
        client.submit(serving, [k], batch_key=f"k{k:02d}") for k in range(20) for _ in range(k + 2)
    ]
    total = len(tickets) + 1

    # When Prometheus scrapes, once every request is in Redis
    def entries() -> tuple[dict[str, float], dict[str, float]] | None:
        text = _scrape(worker.metrics_port)
        depth = _samples(text, "queueserve_queue_depth", "labels")
        pending = _samples(text, "queueserve_pending", "labels")
        return (depth, pending) if sum(depth.values()) + sum(pending.values()) == total else None

    depth, pending = wait_until(entries, "every request counted by a scrape")

    # Then the queue gauges name the declared key and the 3 deepest, and "other" holds the rest
    assert set(depth) == {"default", "k19", "k18", "k17", "other"}, depth
    assert depth["k19"] + pending["k19"] == 21
    assert depth["other"] + pending["other"] == sum(k + 2 for k in range(17))

    # and once every batch ran, the batch-size histogram names the first 3 keys a partition
    # ran besides the declared one, and "other" counts the batches of the rest
    serving.release()
    assert blocker.result(WAIT_S) == ["blocker"]
    assert all(
        t.result(WAIT_S) == [k]
        for t, k in zip(tickets, [k for k in range(20) for _ in range(k + 2)], strict=True)
    )

    def histogram() -> dict[str, float] | None:
        batches = _samples(_scrape(worker.metrics_port), "queueserve_batch_size_count", "labels")
        return batches if sum(batches.values()) == len(serving.batches) else None

    batches = wait_until(histogram, "every batch counted by a scrape")
    assert "other" in batches and len(batches) == 1 + 3 + 1, batches


def _listening_address(port: int) -> str:
    """The address a TCP socket of this host listens on ``port`` (from /proc/net/tcp)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    if len(address) == 8:
                        return socket.inet_ntoa(bytes.fromhex(address)[::-1])
                    return address
    raise AssertionError(f"nothing listens on port {port}")


@pytest.mark.parametrize("host", [None, "0.0.0.0"])
def test_the_metrics_port_listens_on_127_0_0_1_unless_told(
    served: Any,
    host: str | None,
) -> None:
    # Given a worker with metrics, with and without metrics_host
    options = {} if host is None else {"metrics_host": host}
    worker, _ = served(echo("bound"), metrics_port=0, **options)

    # Then it listens on loopback only, unless told where
    assert _listening_address(worker.metrics_port) == (host or "127.0.0.1")
    assert "queueserve_queue_depth" in _scrape(worker.metrics_port)


def _handler_threads() -> int:
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def test_silent_metrics_connections_hold_a_bounded_number_of_threads_for_a_while(
    served: Any,
) -> None:
    # Given a worker with metrics
    worker, _ = served(echo("conns"), metrics_port=0)
    before = _handler_threads()

    # When 30 connections open and say nothing
    silent = [socket.create_connection(("127.0.0.1", worker.metrics_port)) for _ in range(30)]
    try:
        # Then at most MAX_CONNECTIONS threads serve them
        wait_until(lambda: _handler_threads() > before, "the first connections served")
        assert _handler_threads() - before <= MAX_CONNECTIONS

        # and the server drops them once silent long enough, and scrapes work again
        wait_until(lambda: _handler_threads() <= before, "the silent connections dropped")
        assert "queueserve_queue_depth" in _scrape(worker.metrics_port)
    finally:
        for s in silent:
            s.close()
