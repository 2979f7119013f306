"""bench/embed_peers.py's report (medians, table, verdicts, docs block) and its vector check,
on fixed input: no server, no model, no timing."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from bench import embed_peers_report as rep
from bench._verdict import EXIT_MET, EXIT_MISSED, WorkFailed, exit_status
from bench.embed_peers import chunk_texts
from bench.embed_peers_load import Checker

META: dict[str, Any] = {
    "date": "2026-12-07T12:00:00+00:00",
    "git": "abc1234",
    "cores": 2,
    "python": "3.11.7",
    "torch": "2.13.0+cpu",
    "loadavg": "3.0 at the start, 5.5 at most, 2.0 at the end",
    "command": "scripts/bench-embed-peers",
    "passages": 2000,
    "rounds": 2,
    "seconds": 20.0,
    "chunk_texts": 1024,
    "in_flight": 4,
    "calls": 100,
}


def rounds(callers: float, chunks: float, p99: float, cos: float = 1.0) -> list[dict[str, float]]:
    """Two rounds around the given medians: the second 10% above the first's figures."""
    base = {
        "callers_s": callers,
        "chunks_s": chunks,
        "p50_ms": 30.0,
        "p99_ms": 50.0,
        "open_per_s": 0.7 * callers,
        "open_p50_ms": 60.0,
        "open_p99_ms": p99,
        "same_per_s": 15.0,
        "same_p99_ms": p99 / 2,
        "min_cos": cos,
        "vectors": 1000,
    }
    return [base, {k: v * 1.1 if k != "min_cos" else v for k, v in base.items()}]


def results() -> dict[str, dict[str, Any]]:
    return {
        "model": {"rounds": [{"chunks_s": 40.0, "min_cos": 1.0, "vectors": 1024}] * 2},
        "qs-client": {"rounds": rounds(42.0, 39.0, 150.0), "version": "0.1.0"},
        "qs-gateway": {"rounds": rounds(36.0, 28.0, 190.0), "version": "0.1.0"},
        "infinity": {"rounds": rounds(38.0, 27.0, 200.0), "version": "0.0.78"},
        "litserve": {"rounds": rounds(30.0, 30.0, 180.0), "version": "0.2.19"},
        "ray": {"skipped": "pip install failed: no matching distribution"},
    }


def test_summary_is_the_median_and_range_of_the_rounds() -> None:
    stats = rep.summary(results()["infinity"])
    mid, lo, hi = stats["callers_s"]
    assert (lo, hi) == (38.0, pytest.approx(41.8))
    assert mid == pytest.approx(39.9)
    assert "min_cos" not in stats


def test_best_peer_takes_the_best_of_each_figure_among_the_peers_shown() -> None:
    r = results()
    assert rep.best_peer(r, "callers_s", "more") == ("infinity-emb 0.0.78", pytest.approx(39.9))
    assert rep.best_peer(r, "chunks_s", "more") == ("LitServe 0.2.19", pytest.approx(31.5))
    assert rep.best_peer(r, "open_p99_ms", "less") == ("LitServe 0.2.19", pytest.approx(189.0))


def test_verdicts_compare_each_queueserve_door_with_the_best_peer() -> None:
    verdicts = rep.verdicts(results())
    met = [(v.budget.split(",")[0], v.met) for v in verdicts]
    assert met == [
        ("queueserve AsyncClient: `dispatch`; `map(chunk_size=32)`", True),
        ("queueserve AsyncClient: `dispatch`; `map(chunk_size=32)`", True),
        ("queueserve AsyncClient: `dispatch`; `map(chunk_size=32)`", True),
        ("queueserve gateway `/v1/embeddings`", False),  # 36 < infinity's 38
        ("queueserve gateway `/v1/embeddings`", False),  # 28 < LitServe's 30
        ("queueserve gateway `/v1/embeddings`", False),  # 190 ms > LitServe's 180
    ]
    assert verdicts[3].measured == "37.8/s = 0.95x"
    assert "infinity-emb 0.0.78: 39.9/s" in verdicts[3].budget
    assert exit_status(verdicts) == EXIT_MISSED
    assert exit_status(verdicts[:3]) == EXIT_MET


def test_a_peer_below_the_cosine_bound_is_withheld_and_not_the_best() -> None:
    r = results()
    r["infinity"]["rounds"] = rounds(80.0, 80.0, 10.0, cos=0.998)
    assert not rep.shown(r["infinity"])
    assert rep.best_peer(r, "callers_s", "more")[0] == "LitServe 0.2.19"
    row = next(line for line in rep.table(r).splitlines() if "infinity" in line)
    assert "withheld: lowest cosine 0.998000" in row
    assert "80.0" not in row


def test_a_vector_that_is_not_a_number_withholds_the_figures() -> None:
    r = results()
    r["litserve"]["rounds"][1]["min_cos"] = math.nan
    assert not rep.shown(r["litserve"])
    assert math.isnan(rep.min_cosine(r["litserve"]))


def test_queueserve_without_checked_figures_fails_the_run_instead_of_a_verdict() -> None:
    r = results()
    r["qs-gateway"] = {"rounds": [], "failed": "the gateway exited with code 1"}
    with pytest.raises(WorkFailed, match="exited with code 1"):
        rep.verdicts(r)


def test_no_peer_measured_is_printed_but_not_judged() -> None:
    r = results()
    for peer in rep.PEERS:
        r[peer] = {"skipped": "not installed"}
    verdicts = rep.verdicts(r)
    assert verdicts and all(not v.judged for v in verdicts)
    assert exit_status(verdicts) == EXIT_MET


def test_table_has_a_row_per_system_with_ratios_to_the_model_alone() -> None:
    lines = rep.table(results()).splitlines()
    assert len(lines) == 2 + 6
    client = next(line for line in lines if "AsyncClient" in line)
    # median 44.1/s, 42.0-46.2 over the rounds, 44.1 / 40 = 1.10x the model alone
    assert "44.1 (42.0-46.2); 1.10x" in client
    assert "| 32 (30-33) / 52 (50-55) |" in client  # one caller's p50 / p99, ms
    ray = next(line for line in lines if "Ray Serve" in line)
    assert "not installed: pip install failed" in ray


def test_docs_block_replaces_only_its_own_section() -> None:
    block = rep.docs_block(results(), ["verdict: x: met"], META)
    assert block.startswith(rep.BEGIN) and block.endswith(rep.END)
    assert "`scripts/bench-embed-peers`" in block and "5.5 at most" in block
    doc = f"# Benchmarks\n\n## Peers\n\nkept\n\n## Embedding peers\n\n{rep.BEGIN}\nold\n{rep.END}\n"
    new = rep.replace_block(doc, block, "Embedding peers")
    assert "old" not in new and "kept" in new and new.count(rep.BEGIN) == 1
    assert "    verdict: x: met" in new
    added = rep.replace_block("# Benchmarks\n", block, "Embedding peers")
    assert added.startswith("# Benchmarks\n\n## Embedding peers\n\n" + rep.BEGIN)


def test_checker_keeps_the_lowest_cosine_and_refuses_a_wrong_count() -> None:
    reference = np.eye(3, 4, dtype=np.float32) * 2.0
    checker = Checker(reference)
    checker.check("x", [0, 1], np.eye(2, 4) * 5.0)
    assert checker.min_cos == pytest.approx(1.0)
    tilted = np.array([[0.0, 0.0, 1.0, 1.0]])  # 45 degrees off text 2's vector
    checker.check("x", [2], tilted)
    assert checker.min_cos == pytest.approx(math.sqrt(0.5))
    assert checker.vectors == 3
    checker.check("x", [0], np.array([[math.nan, 0.0, 0.0, 0.0]]))
    checker.check("x", [0], np.array([[1.0, 0.0, 0.0, 0.0]]))
    assert math.isnan(checker.min_cos)  # a NaN vector is never forgotten
    with pytest.raises(WorkFailed, match="2 texts sent"):
        checker.check("x", [0, 1], np.eye(1, 4))


def test_rounds_send_the_corpus_in_turn_and_cover_it() -> None:
    assert chunk_texts(10, 4, 0) == [0, 1, 2, 3]
    assert chunk_texts(10, 4, 2) == [8, 9, 0, 1]
    covered = {i for r in range(2) for i in chunk_texts(2000, 1024, r)}
    assert covered == set(range(2000))


def test_a_run_of_peers_alone_judges_nothing() -> None:
    r = results()
    del r["qs-client"], r["qs-gateway"]  # --only infinity --only litserve
    assert rep.verdicts(r) == []


def test_the_no_wait_variant_is_shown_but_neither_judged_nor_a_peer() -> None:
    r = results()
    # fastest of all and lowest p99: were it a peer or judged, the verdicts would change
    r["qs-nowait"] = {"rounds": rounds(60.0, 50.0, 20.0), "version": "0.1.0"}
    assert rep.best_peer(r, "open_p99_ms", "less") == ("LitServe 0.2.19", pytest.approx(189.0))
    assert [v.met for v in rep.verdicts(r)] == [v.met for v in rep.verdicts(results())]
    assert "| queueserve 0.1.0 | AsyncClient, `batch_timeout=0`" in rep.table(r)
    assert ("queueserve nowait", pytest.approx(rep.summary(r["qs-nowait"])["callers_s"][0])) in [
        (name, figures.get("callers_s")) for name, figures in rep.chart_rows(r)
    ]


def test_the_table_gives_each_system_its_p99_at_the_one_rate_for_all() -> None:
    table = rep.table(results())
    row = next(line for line in table.splitlines() if "LitServe" in line)
    # p99 90 and 99 ms over the two rounds, offered 15 and 16.5/s
    assert "| 94 (90-99) (15.8/s) |" in row
    assert "p99 ms at one rate for all (offered/s)" in table.splitlines()[0]
