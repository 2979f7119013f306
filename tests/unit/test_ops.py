"""The operator commands (docs/design.md §7) on fakeredis: `queueserve stats`, `config get|set`,
`dead-letter list|drop`, and the broker calls under them.

fakeredis models what these use faithfully (streams, consumer groups, XINFO GROUPS with lag and
entries-read, XPENDING, hashes, sorted sets, SCAN, MULTI); tests/integration/
test_fakeredis_fidelity.py runs the same broker calls on fakeredis and on a real Redis and
compares the answers. What needs Lua or real timing stays on a real Redis: `dead-letter replay`
(replay.lua; tests/faults/test_guarantees.py), and a running worker picking up `config set`
(tests/integration/test_runtime_config.py).
"""

from __future__ import annotations

import ast
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fakeredis
import msgpack
import pytest
import redis

from queueserve.ops import stats
from queueserve.ops.cli import main
from queueserve.ops.deadletter import DeadLetters
from queueserve.wire.keys import Keys
from queueserve.wire.protocol import H_ID
from queueserve.worker.worker import EXIT_ERROR, EXIT_OK, EXIT_USAGE
from tests.support.broker import RedisBroker
from tests.support.helpers import REPO

PREFIX = "qsunit"
URL = "redis://fake.invalid:6379/0"  # never dialled: the fake_redis fixture answers every URL


@pytest.fixture
def broker(fake_redis: fakeredis.FakeServer) -> RedisBroker:
    """A broker on the test's fakeredis, as a worker would hold it."""
    return RedisBroker(URL)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main([*args, "--redis-url", URL, "--prefix", PREFIX])
    out, err = capsys.readouterr()
    return code, out, err


def enqueue(broker: RedisBroker, keys: Keys, batch_key: str, n: int) -> list[bytes]:
    """``n`` one-item request entries on one stream, with the bookkeeping enqueue.lua keeps
    (the key's last-seen time, queued items per key and priority, and in all), and a group
    already made."""
    stream = keys.stream(batch_key)
    broker.redis.zadd(keys.seen, {batch_key: int(time.time() * 1000)})
    broker.redis.hincrby(keys.depth, batch_key, n)
    broker.redis.hincrby(keys.pdepth, "0", n)
    broker.redis.incrby(keys.queued, n)
    broker.ensure_group(stream)
    return [
        broker.redis.xadd(stream, {"h": b"header", "p": b"payload", "a": b"1"}) for _ in range(n)
    ]


# --- queueserve stats ----------------------------------------------------------------------


COLUMNS = [
    "serving",
    "key",
    "items",
    "waiting",
    "pending",
    "oldest",
    "seen",
    "req/s",
    "workers",
    "dead",
]


def rows(out: str) -> dict[tuple[str, str], list[str]]:
    """The table `stats` prints, by (serving, batch key), without the two clock-dependent
    columns (oldest item's age, last seen), which ``ages`` returns."""
    lines = out.strip().split("\n\n")[0].splitlines()
    assert lines[0].split() == COLUMNS
    return {(c[0], c[1]): c[2:5] + c[7:] for c in (line.split() for line in lines[1:])}


def ages(out: str) -> dict[tuple[str, str], list[str]]:
    lines = out.strip().split("\n\n")[0].splitlines()[1:]
    return {(c[0], c[1]): c[5:7] for c in (line.split() for line in lines)}


def by_priority(out: str) -> dict[tuple[str, str], str]:
    """The second table `stats` prints: items queued by (serving, priority); {} when none."""
    tables = out.strip().split("\n\n")
    if len(tables) < 2:
        return {}
    lines = tables[1].splitlines()
    assert lines[0].split() == ["serving", "priority", "items", "oldest"]
    return {(c[0], c[1]): c[2] for c in (line.split() for line in lines[1:])}


def sampling(sleep: Callable[[float], None]) -> types.SimpleNamespace:
    """``stats``'s clock, with the throughput interval replaced by ``sleep``."""
    return types.SimpleNamespace(sleep=sleep, time=time.time)


def test_stats_shows_waiting_pending_lag_throughput_workers_and_dead_letters(
    broker: RedisBroker, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a serving with 6 requests on "default" (2 read by a live worker), 1 on "big",
    # and one request the worker dead-lettered
    keys = Keys(PREFIX, "square")
    broker.declare(keys, {"batch_size": 8})
    ids = enqueue(broker, keys, "default", 6)
    enqueue(broker, keys, "big", 1)
    broker.read("w1", [keys.stream("default")], 2, 0)
    broker.heartbeat([keys], "w1", 10_000, {"host": "h"})
    broker.dead_letter(keys, keys.stream("default"), ids[0], {"reason": "boom"}, ack_now=True)

    # When the worker reads 3 more during the 2 s the command samples throughput over
    def sampled(seconds: float) -> None:
        assert seconds == 2.0
        broker.read("w1", [keys.stream("default")], 3, 0)

    monkeypatch.setattr(stats, "time", sampling(sampled))
    code, out, _ = cli(capsys, "stats", "--interval", "2s")

    # Then each batch key has its own row, and throughput is entries read per second
    assert code == EXIT_OK
    assert rows(out) == {
        # items queued, waiting, pending, req/s, workers, dead
        ("square", "big"): ["1", "1", "0", "0.0", "1", "1"],
        ("square", "default"): ["6", "1", "4", "1.5", "1", "1"],
    }
    # and the items queued by priority, every key
    assert by_priority(out) == {("square", "0"): "7"}
    # with the oldest item's age and when the key was last enqueued to, both just now
    for oldest, seen in ages(out).values():
        assert oldest.endswith(("ms", "s")) and seen.endswith(("ms", "s"))


def test_stats_counts_what_is_left_after_an_unread_entry_is_deleted(
    broker: RedisBroker, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an entry deleted (and its item released) before any worker read it, as a
    # cancelled request is
    keys = Keys(PREFIX, "square")
    broker.declare(keys, {"batch_size": 8})
    ids = enqueue(broker, keys, "default", 3)
    broker.redis.xdel(keys.stream("default"), ids[1])
    broker.redis.hincrby(keys.depth, "default", -1)
    monkeypatch.setattr(stats, "time", sampling(lambda seconds: None))

    code, out, _ = cli(capsys, "stats", "square")

    assert code == EXIT_OK
    assert rows(out) == {("square", "default"): ["2", "2", "0", "0.0", "0", "0"]}


def test_stats_lists_every_declared_serving_and_says_when_there_is_none(
    broker: RedisBroker, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stats, "time", sampling(lambda seconds: None))
    assert cli(capsys, "stats") == (EXIT_OK, f"no servings under prefix {PREFIX!r}\n", "")

    for name in ("cube", "square"):
        broker.declare(Keys(PREFIX, name), {"batch_size": 8})
    broker.declare(Keys("otherprefix", "elsewhere"), {"batch_size": 8})
    code, out, _ = cli(capsys, "stats")

    # a serving with no stream yet still gets a row, with dashes for the key
    assert code == EXIT_OK
    assert rows(out) == {
        ("cube", "-"): ["0", "0", "0", "0.0", "0", "0"],
        ("square", "-"): ["0", "0", "0", "0.0", "0", "0"],
    }
    assert [tuple(a) for a in ages(out).values()] == [("-", "-")] * 2


def test_stats_lists_the_declared_servings_without_a_scan_and_names_the_undeclared_waiting(
    broker: RedisBroker, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given two declared servings, and items waiting on a name no worker declared
    for name in ("cube", "square"):
        broker.declare(Keys(PREFIX, name), {"batch_size": 8})
    broker.redis.set(Keys(PREFIX, "sqaure").queued, 3)
    scans: list[str] = []
    scan_iter = redis.Redis.scan_iter

    def counted(self: redis.Redis, match: str | None = None, **kw: Any) -> Any:
        scans.append(str(match))
        return scan_iter(self, match=match, **kw)

    monkeypatch.setattr(redis.Redis, "scan_iter", counted)
    monkeypatch.setattr(stats, "time", sampling(lambda seconds: None))

    # When an operator runs queueserve stats for every serving
    code, out, _ = cli(capsys, "stats")

    # Then it names the undeclared one and shows the declared ones, read from the servings
    # registry the workers keep: the meta keys are never scanned (once before, twice before
    # that; issue 38). Only the admission counters are, to find the undeclared ones.
    assert code == EXIT_OK
    assert out.startswith("'sqaure': 3 items waiting, and no worker ever declared")
    assert {serving for serving, _ in rows(out.split("\n", 1)[1])} == {"cube", "square"}
    assert [m for m in scans if m.endswith(":meta")] == []


# --- queueserve config get|set -------------------------------------------------------------


def test_config_set_stores_overrides_and_shows_them_beside_the_declared_options(
    broker: RedisBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = Keys(PREFIX, "sizes")
    broker.declare(keys, {"batch_size": 8, "batch_timeout": 0.01, "max_queue": 100})

    code, out, _ = cli(capsys, "config", "set", "sizes", "batch_size=16", "batch_timeout=5ms")

    assert code == EXIT_OK
    assert out.splitlines() == [
        "batch_size = 16  (set at run time)",
        "batch_timeout = 0.005  (set at run time)",
        "max_queue = 100",
    ]
    # workers watch the config hash; clients read max_queue and codec from meta
    assert broker.config(keys) == {"batch_size": "16", "batch_timeout": "0.005"}
    assert broker.meta(keys)["batch_size"] == "16"
    assert cli(capsys, "config", "get", "sizes") == (EXIT_OK, out, "")


@pytest.mark.parametrize(
    ("assignment", "says"),
    [
        ("batch_size=0", "batch_size"),
        ("batch_size=many", "'many'"),
        ("batch_timeout=soon", "batch_timeout"),
        ("colour=red", "'colour' cannot be changed at run time; choose from batch_size"),
        ("batch_size", "'batch_size' is not option=value"),
    ],
)
def test_config_set_refuses_bad_assignments_and_changes_nothing(
    broker: RedisBroker, capsys: pytest.CaptureFixture[str], assignment: str, says: str
) -> None:
    keys = Keys(PREFIX, "sizes")
    broker.declare(keys, {"batch_size": 8})

    code, _, err = cli(capsys, "config", "set", "sizes", "max_queue=5", assignment)

    assert code == EXIT_ERROR
    assert says in err, err
    assert broker.config(keys) == {}
    assert broker.meta(keys) == {"batch_size": "8"}


def test_config_set_without_assignments_is_a_usage_error(
    broker: RedisBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, "config", "set", "sizes")
    assert code == EXIT_USAGE
    assert "option=value" in err


# --- queueserve dead-letter list|drop ------------------------------------------------------


def dead_lettered(broker: RedisBroker, keys: Keys, reasons: list[str]) -> list[str]:
    """Requests read by a worker and dead-lettered the way the worker does it; their ids."""
    broker.declare(keys, {"batch_size": 8})  # as the worker serving it did
    entry_ids = enqueue(broker, keys, "default", len(reasons))
    broker.read("w1", [keys.stream("default")], len(reasons), 0)
    header = msgpack.packb([1, 7, 1, "inbox", 0, "msgpack"])
    for entry_id, reason in zip(entry_ids, reasons, strict=True):
        broker.dead_letter(
            keys,
            keys.stream("default"),
            entry_id,
            {"reason": reason, "deliveries": 4, "field:h": header, "field:p": b"payload"},
            ack_now=True,
        )
    return [r.id for r in DeadLetters(broker, PREFIX, keys.name).records()]


def test_dead_letters_keep_where_they_came_from_and_the_request_as_sent(
    broker: RedisBroker,
) -> None:
    keys = Keys(PREFIX, "crasher")
    dead_lettered(broker, keys, ["killed its workers"])
    (record,) = DeadLetters(broker, PREFIX, "crasher").records()
    assert (record.stream, record.reason, record.deliveries) == (
        keys.stream("default"),
        "killed its workers",
        4,
    )
    assert record.entry_id.count("-") == 1 and record.at_ms > 0
    assert msgpack.unpackb(record.header)[H_ID] == 7 and record.payload == b"payload"
    # dead-lettering acked and deleted the entry: it waits for nobody any more
    assert broker.redis.xlen(keys.stream("default")) == 0
    assert broker.pending_consumers(keys.stream("default")) == []


def test_dead_letter_list_prints_id_origin_deliveries_and_reason_up_to_the_limit(
    broker: RedisBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = Keys(PREFIX, "crasher")
    ids = dead_lettered(broker, keys, ["first reason", "second reason", "third reason"])

    code, out, _ = cli(capsys, "dead-letter", "list", "crasher", "--limit", "2")

    assert code == EXIT_OK
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ids[:2]
    assert lines[0].endswith("deliveries=4  first reason")
    assert f"from {keys.stream('default')} " in lines[0]


def test_dead_letter_drop_removes_the_named_ones_or_all(
    broker: RedisBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = Keys(PREFIX, "crasher")
    ids = dead_lettered(broker, keys, ["a", "b", "c"])

    assert cli(capsys, "dead-letter", "drop", "crasher", ids[1]) == (
        EXIT_OK,
        f"{ids[1]} dropped\n",
        "",
    )
    assert [r.id for r in DeadLetters(broker, PREFIX, "crasher").records()] == [ids[0], ids[2]]

    code, out, err = cli(capsys, "dead-letter", "drop", "crasher", ids[1])
    assert (code, err) == (EXIT_ERROR, f"{ids[1]}: no such dead letter\n")

    code, out, _ = cli(capsys, "dead-letter", "drop", "crasher", "--all")
    assert (code, out) == (EXIT_OK, f"{ids[0]} dropped\n{ids[2]} dropped\n")
    assert broker.redis.xlen(keys.dead) == 0


@pytest.mark.parametrize("args", [[], ["1-0", "--all"]], ids=["neither", "both"])
def test_dead_letter_drop_takes_ids_or_all_but_not_both(
    broker: RedisBroker, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    ids = dead_lettered(broker, Keys(PREFIX, "crasher"), ["kept"])
    code, _, err = cli(capsys, "dead-letter", "drop", "crasher", *args)
    assert code == EXIT_USAGE
    assert "takes dead-letter ids or --all" in err
    assert [r.id for r in DeadLetters(broker, PREFIX, "crasher").records()] == ids


@pytest.mark.parametrize("text", ["inf", "1e400GiB", "nan", "-inf", "lots"])
def test_a_memory_limit_that_is_no_number_of_bytes_is_refused_with_an_example(text: str) -> None:
    from queueserve.options.units import parse_bytes

    with pytest.raises(ValueError, match="a number of bytes like 2GiB"):
        parse_bytes(text, "max_partition_memory")


@pytest.mark.parametrize("interval", ["0", "0s", "0ms"])
def test_stats_refuses_an_interval_it_cannot_divide_by(
    capsys: pytest.CaptureFixture[str], interval: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["stats", f"--interval={interval}", "--redis-url", URL, "--prefix", PREFIX])
    assert exited.value.code == EXIT_USAGE
    assert "must be more than 0" in capsys.readouterr().err


def exit_codes(path: Path) -> list[tuple[str, object]]:
    """(name, value) of each module-level ``EXIT_*`` assignment in ``path``, tuples unpacked."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (
                zip(target.elts, node.value.elts, strict=False)
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                else [(target, node.value)]
            )
            for name, value in pairs:
                if isinstance(name, ast.Name) and name.id.startswith("EXIT_"):
                    found.append((name.id, ast.literal_eval(value)))
    return found


def test_each_exit_code_of_the_command_line_is_defined_once() -> None:
    # Every command returns the codes EPILOG and docs/operations.md list: a module keeping a
    # copy of its own (ops/job_commands.py did, with EXIT_FAILED for 1) can drift from them unseen
    names: dict[str, list[str]] = {}
    values: dict[object, set[str]] = {}
    for path in sorted((REPO / "queueserve").rglob("*.py")):
        for name, value in exit_codes(path):
            names.setdefault(name, []).append(str(path.relative_to(REPO)))
            values.setdefault(value, set()).add(name)
    assert {name: where for name, where in names.items() if len(where) > 1} == {}
    assert {value: found for value, found in values.items() if len(found) > 1} == {}
