"""Real model benchmark: MiniLM through queueserve vs the same model in a tight loop (issue 6).

Both sides run the same code (``tasks.embed.Embed.embed_texts``: tokenize, BERT, mean pool,
normalize) on the same texts, in batches of the same size, with the same torch thread count:

- **direct**: this process calls the model on consecutive batches, nothing else running;
- **served**: ``queueserve worker bench.model_servings:BenchEmbed`` (one partition, that thread
  count) while this process keeps it saturated with ``client.map`` (8 batches in flight).

Runs alternate (direct, served, direct, ...) so a machine whose load drifts hurts both alike;
the medians give the ratio (budget >= 0.95, docs/design.md §8). Rates are steady state: from the end
of the first batch to the end of the last. It also prints the padded-token waste of the demo
corpus with and without length-bucket batch keys (tokenizer only, no model).

    python -m bench.model [--quick] [--json out.json] [--threads 1,2] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from ._harness import Rate, RedisServer, spawn_module, stop_process

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PREFIX = "bm"
IN_FLIGHT = 8  # batches queued ahead of the worker: saturating


# --- padding ------------------------------------------------------------------------------
def padded_waste(lengths: Sequence[int], keys: Sequence[str], batch_size: int) -> float:
    """Padded tokens / real tokens when items are cut into batches of ``batch_size`` per key,
    in arrival order, each batch padded to its longest item (what the worker does)."""
    by_key: dict[str, list[int]] = {}
    for n, key in zip(lengths, keys, strict=True):
        by_key.setdefault(key, []).append(n)
    padded = 0
    for group in by_key.values():
        for i in range(0, len(group), batch_size):
            batch = group[i : i + batch_size]
            padded += max(batch) * len(batch) - sum(batch)
    return padded / sum(lengths)


def padding_table(limit: int | None, batch_size: int) -> dict[str, Any]:
    from tasks.corpus import stdlib_passages
    from tasks.embed import bucket_of, length_bucket, load_tokenizer

    texts = [p.text for p in stdlib_passages(limit)]
    tokenizer = load_tokenizer()
    tokenizer.no_padding()
    lengths = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    started = time.perf_counter()
    estimated = [length_bucket(t) for t in texts]
    key_us = (time.perf_counter() - started) / len(texts) * 1e6
    return {
        "passages": len(texts),
        "real_tokens": sum(lengths),
        "batch_size": batch_size,
        "no_buckets": padded_waste(lengths, ["default"] * len(texts), batch_size),
        "buckets_estimated": padded_waste(lengths, estimated, batch_size),
        "buckets_exact": padded_waste(lengths, [bucket_of(n) for n in lengths], batch_size),
        "sorted_lower_bound": padded_waste(sorted(lengths), ["default"] * len(texts), batch_size),
        "key_cost_us": key_us,
    }


def padding_timing(limit: int | None, batch_size: int, threads: int) -> dict[str, float]:
    """Seconds to embed the demo corpus directly, batched without and with length buckets
    (the batches ``padded_waste`` counts): what the saved padding is worth in compute."""
    import torch

    import queueserve as qs
    from tasks.corpus import stdlib_passages
    from tasks.embed import Embed, length_bucket

    torch.set_num_threads(threads)
    texts = [p.text for p in stdlib_passages(limit)]
    model = Embed()
    model.setup(qs.Partition())
    model.embed_texts(texts[:batch_size])  # warm
    out = {}

    def one_key(_text: str) -> str:
        return "default"

    keyings: list[tuple[str, Callable[[str], str]]] = [
        ("no_buckets", one_key),
        ("buckets_estimated", length_bucket),
    ]
    for name, key in keyings:
        groups: dict[str, list[str]] = {}
        for t in texts:
            groups.setdefault(key(t), []).append(t)
        started = time.perf_counter()
        for group in groups.values():
            for i in range(0, len(group), batch_size):
                model.embed_texts(group[i : i + batch_size])
        out[name] = time.perf_counter() - started
    return out


# --- direct vs served ---------------------------------------------------------------------
def bench_texts(bucket: str, batches: int, batch_size: int) -> list[str]:
    """``batches * batch_size`` passages of one length bucket (repeated when too few)."""
    from tasks.corpus import stdlib_passages
    from tasks.embed import length_bucket

    pool = [p.text for p in stdlib_passages() if length_bucket(p.text) == bucket]
    need = batches * batch_size
    return (pool * (need // len(pool) + 1))[:need]


def _steady_rate(
    run_batches: Callable[[Callable[[], None]], None], items: int, batch_size: int
) -> float:
    """Items/s from the end of the first batch to the end of the last."""
    marks: list[float] = []
    run_batches(lambda: marks.append(time.perf_counter()))
    end = time.perf_counter()
    return (items - batch_size) / (end - marks[0])


def direct_rate(model: Any, texts: list[str], batch_size: int) -> float:
    def run(first_done: Callable[[], None]) -> None:
        for i in range(0, len(texts), batch_size):
            model.embed_texts(texts[i : i + batch_size])
            if i == 0:
                first_done()

    return _steady_rate(run, len(texts), batch_size)


def served_rate(client: Any, texts: list[str], batch_size: int) -> float:
    def run(first_done: Callable[[], None]) -> None:
        results = client.map(
            "embed_bench", texts, chunk_size=batch_size, max_in_flight=IN_FLIGHT, timeout=600
        )
        for done, _ in enumerate(results, 1):
            if done == batch_size:
                first_done()

    return _steady_rate(run, len(texts), batch_size)


def _served_counters(r: redis.Redis) -> tuple[float, int, int]:
    busy, batches, items = r.mget("bench:model:busy", "bench:model:batches", "bench:model:items")
    return float(busy or 0), int(batches or 0), int(items or 0)


def _rate_json(rate: Rate) -> dict[str, Any]:
    """Rate.as_json rounds to whole items/s; a CPU model needs the decimals."""
    return {
        "median": round(rate.median, 2),
        "min": round(min(rate.runs), 2),
        "max": round(max(rate.runs), 2),
        "runs": [round(x, 2) for x in rate.runs],
    }


def run_case(
    url: str, threads: int, batch_size: int, batches: int, reps: int, bucket: str
) -> dict[str, Any]:
    import torch

    import queueserve as qs
    from tasks.embed import Embed

    texts = bench_texts(bucket, batches, batch_size)
    os.environ.update(
        QS_BENCH_THREADS=str(threads), QS_BENCH_BATCH=str(batch_size), QS_BENCH_URL=url
    )
    worker = spawn_module(
        "queueserve",
        "worker",
        "bench.model_servings:BenchEmbed",
        "--redis-url",
        url,
        "--prefix",
        f"{PREFIX}{threads}",
        "--partitions",
        "1",
        "--log-level",
        "WARNING",
    )
    r = redis.Redis.from_url(url)
    client = qs.Client(url, prefix=f"{PREFIX}{threads}")
    try:
        torch.set_num_threads(threads)
        model = Embed()
        model.setup(qs.Partition())
        model.embed_texts(texts[:batch_size])  # warm: first-call allocations
        client.dispatch_many("embed_bench", texts[:batch_size], timeout=300)  # worker warm
        direct, served, busy_ratio, mean_batch, batch_s = [], [], [], [], []
        for _ in range(reps):
            direct.append(direct_rate(model, texts, batch_size))
            before = _served_counters(r)
            started = time.perf_counter()
            served.append(served_rate(client, texts, batch_size))
            wall = time.perf_counter() - started
            after = _served_counters(r)
            batches_run = max(1, after[1] - before[1])
            busy_ratio.append((after[0] - before[0]) / wall)
            mean_batch.append((after[2] - before[2]) / batches_run)
            batch_s.append((after[0] - before[0]) / batches_run)
    finally:
        client.close()
        stop_process(worker, timeout=60)
        r.close()
    d, s = Rate(direct), Rate(served)
    return {
        "threads": threads,
        "batch_size": batch_size,
        "bucket": bucket,
        "batches_per_run": batches,
        "direct": _rate_json(d),
        "served": _rate_json(s),
        "ratio": s.median / d.median,
        "served_busy_ratio": statistics.median(busy_ratio),
        "served_mean_batch": statistics.median(mean_batch),
        # The model's own time per batch, in the worker and in the direct loop: with the
        # worker busy ~100% of the time, a ratio under 1 is the model running slower there
        # (CPU shared with the client, Redis and the worker's I/O threads), not idling.
        "served_model_ms_per_batch": statistics.median(batch_s) * 1000,
        "direct_ms_per_batch": batch_size / d.median * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs (smoke test)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--threads",
        default="1,2",
        help="torch thread counts to compare at, comma-separated (default 1,2)",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--bucket", default="t64", help="length bucket of the texts (t16..t256; default t64)"
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=1200,
        help="demo corpus size for the padding figures (default 1200)",
    )
    parser.add_argument(
        "--padding-timing",
        action="store_true",
        help="also time embedding the demo corpus with and without buckets",
    )
    args = parser.parse_args()
    batches, reps = (6, 2) if args.quick else (20, 3)

    pad = padding_table(args.limit, args.batch_size)
    print(
        f"padded-token waste, {pad['passages']} demo passages ({pad['real_tokens']} tokens), "
        f"batch {pad['batch_size']}, padded/real tokens:"
    )
    for name in ("no_buckets", "buckets_estimated", "buckets_exact", "sorted_lower_bound"):
        print(f"  {name:<20} {pad[name]:6.3f}")
    print(f"  (estimated key: {pad['key_cost_us']:.2f} us per text in the caller)", flush=True)
    if args.padding_timing:
        threads = os.cpu_count() or 1
        pad["timing_s"] = timing = padding_timing(args.limit, args.batch_size, threads)
        print(
            f"  embedding them directly ({threads} threads): no buckets "
            f"{timing['no_buckets']:.1f}s, buckets {timing['buckets_estimated']:.1f}s "
            f"({timing['no_buckets'] / timing['buckets_estimated']:.2f}x faster)",
            flush=True,
        )

    server = RedisServer().start()
    cases = []
    try:
        for threads in (int(t) for t in args.threads.split(",")):
            c = run_case(server.url, threads, args.batch_size, batches, reps, args.bucket)
            cases.append(c)
            print(
                f"threads={threads} batch={c['batch_size']} ({c['bucket']} texts)  "
                f"direct {c['direct']['median']:6.1f}/s  served {c['served']['median']:6.1f}/s"
                f"  ratio {c['ratio']:.3f} (budget >= 0.95)  worker busy "
                f"{c['served_busy_ratio']:.2f}, mean batch {c['served_mean_batch']:.1f}, model "
                f"{c['served_model_ms_per_batch']:.0f} ms/batch served vs "
                f"{c['direct_ms_per_batch']:.0f} direct  "
                f"[direct runs {c['direct']['runs']}, served {c['served']['runs']}]",
                flush=True,
            )
    finally:
        server.stop()
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} (cores: {os.cpu_count()})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "padding": pad,
                    "model": cases,
                    "batches": batches,
                    "reps": reps,
                    "loadavg": load,
                    "cores": os.cpu_count(),
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
