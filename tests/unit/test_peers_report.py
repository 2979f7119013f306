"""bench/peers.py's report (table, docs section, chart) and its measuring helpers, on fixed
input: no peer, no Redis, no timing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import peers
from bench.peers_runners import _measure

RQ = "rq (default worker, fork per job)"
META: dict[str, Any] = {
    "date": "2026-11-23T10:00:00+00:00",
    "cores": 2,
    "platform": "Linux-test",
    "python": "3.11.7",
    "redis_server": "7.0.15",
    "loadavg": (1.5, 1.0, 0.5),
    "git": "abc1234",
    "command": "scripts/bench-peers",
    "items": 5000,
    "fast_items": 50000,
    "map_items": 1000000,
    "window": 256,
    "repeats": 3,
    "rt_calls": 500,
}


def results() -> list[dict[str, Any]]:
    return [
        {
            "key": "rq",
            "versions": {"rq": "3.0.0"},
            "setup": "fork | per job",
            "items_per_s": 180,
            "p50_ms": 12.5,
            "p99_ms": 30.25,
        },
        {
            "key": "queueserve",
            "versions": {"queueserve": "0.1.0", "redis": "8.1.0"},
            "setup": "noop",
            "items_per_s": 45848,
            "p50_ms": 0.5,
            "p99_ms": 1.25,
            "cpu_us_per_item": {"client": 15.31, "worker": 11.3, "redis": 6.6},
        },
        {
            "key": "queueserve-map",
            "versions": {"queueserve": "0.1.0"},
            "setup": "map",
            "items_per_s": 812345,
        },
        {"key": "arq", "skipped": "arq is not installed: run scripts/bench-peers"},
        {"key": "celery-solo", "failed": "celery-solo: exited with code 1"},
    ]


def test_table_lists_systems_fastest_first_then_those_without_figures() -> None:
    lines = peers.table(results()).splitlines()

    assert lines[0].startswith("| system | items/s | p50 ms | p99 ms | CPU µs/item")
    systems = [line.split(" | ")[0].removeprefix("| ") for line in lines[2:]]
    assert systems == [
        "queueserve map (256/request)",
        "queueserve submit",
        RQ,
        "arq",
        "Celery (solo pool)",
    ]
    assert "| 812,345 | — | — | — |" in lines[2]  # map has no latency of its own
    assert (
        "| 45,848 | 0.50 | 1.25 | 15.3 / 11.3 / 6.6 | queueserve 0.1.0, redis 8.1.0 |" in (lines[3])
    )
    assert "| fork \\| per job |" in lines[4]
    assert "skipped: arq is not installed: run scripts/bench-peers" in lines[5]
    assert "failed: celery-solo: exited with code 1" in lines[6]


def test_table_escapes_a_reason_that_would_break_the_markdown_row() -> None:
    row = peers.table([{"key": "rq", "failed": "a | b\nc"}]).splitlines()[2]

    assert row == f"| {RQ} | — | — | — | — | — | failed: a \\| b c |"


def test_console_line_names_versions_and_why_a_system_was_not_measured() -> None:
    rq, _, qs_map, arq, _ = results()

    assert "180 items/s" in peers.line(rq) and "p99 30.25 ms" in peers.line(rq)
    assert "(rq 3.0.0)" in peers.line(rq)
    assert "p50" not in peers.line(qs_map)
    assert peers.line(arq).endswith("skipped: arq is not installed: run scripts/bench-peers")


def test_docs_block_carries_the_run_its_command_and_the_table() -> None:
    block = peers.docs_block(results(), META)

    assert block.startswith(peers.BEGIN) and block.endswith(peers.END)
    assert "2026-11-23T10:00:00+00:00" in block and "2 cores" in block
    assert "Redis 7.0.15" in block and "`scripts/bench-peers`" in block
    assert "commit `abc1234`" in block
    assert peers.table(results()) in block


def test_replace_block_swaps_only_the_marked_part() -> None:
    doc = f"# Benchmarks\n\n## Peers\n\nprose\n\n{peers.BEGIN}\nold\n{peers.END}\n\nafter\n"

    new = peers.replace_block(doc, f"{peers.BEGIN}\nnew\n{peers.END}")

    assert new == f"# Benchmarks\n\n## Peers\n\nprose\n\n{peers.BEGIN}\nnew\n{peers.END}\n\nafter\n"
    assert peers.replace_block(new, f"{peers.BEGIN}\nnew\n{peers.END}") == new


def test_replace_block_adds_a_peers_section_to_a_doc_without_one() -> None:
    new = peers.replace_block("# Benchmarks\n\ntext\n", f"{peers.BEGIN}\nx\n{peers.END}")

    assert new == f"# Benchmarks\n\ntext\n\n## Peers\n\n{peers.BEGIN}\nx\n{peers.END}\n"


def test_chart_rows_are_the_measured_systems_fastest_first() -> None:
    rows = peers.chart_rows(results())

    assert rows == [
        ("queueserve map (256/request)", 812345.0, None, None),
        ("queueserve submit", 45848.0, 0.5, 1.25),
        (RQ, 180.0, 12.5, 30.25),
    ]


def test_render_chart_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the chart needs the `peers` extra")
    path = tmp_path / "img" / "peers.png"

    peers.render_chart(results(), path, peers.subtitle(META))

    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_render_chart_refuses_a_run_with_nothing_measured(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the chart needs the `peers` extra")
    nothing = [r for r in results() if "items_per_s" not in r]

    with pytest.raises(ValueError, match="every one was skipped"):
        peers.render_chart(nothing, tmp_path / "peers.png", "")


def test_rate_sends_every_item_in_windows_and_checks_the_results() -> None:
    windows: list[range] = []

    def run_window(part: range) -> list[int]:
        windows.append(part)
        return list(part)

    out = _measure.rate(run_window, items=10, window=4, repeats=2, seconds=60)

    assert windows == [range(0, 4), range(4, 8), range(8, 10)] * 2
    assert out["items"] == [10, 10] and out["window"] == 4 and len(out["runs"]) == 2


def test_rate_fails_on_a_wrong_result() -> None:
    with pytest.raises(AssertionError, match="wrong results"):
        _measure.rate(lambda part: [x + 1 for x in part], items=4, window=4, repeats=1, seconds=60)


def test_rate_stops_at_its_time_bound_after_one_window() -> None:
    calls: list[range] = []

    out = _measure.rate(
        lambda part: calls.append(part) or list(part), items=100, window=10, repeats=3, seconds=0
    )

    assert calls == [range(0, 10)] and out["items"] == [10]


def test_latency_counts_its_calls_and_checks_each_result() -> None:
    out = _measure.latency(lambda i: i, calls=7, warmup=2, seconds=60)

    assert out["calls"] == 7 and 0 <= out["p50_ms"] <= out["p99_ms"]
    with pytest.raises(AssertionError, match="wrong results"):
        _measure.latency(lambda i: -1, calls=1, warmup=0, seconds=60)


def test_a_missing_peer_is_named_with_its_pinned_install_line() -> None:
    assert _measure.pinned("arq") == "arq==0.28.0"
    assert _measure.pinned("celery") == "celery[redis]==5.6.3"
    assert _measure.pinned("celery-batches") == "celery-batches==0.11"
