"""MiniLM on a GPU: how close does serving come to the model alone? (issue 13)

For each batch size (32 to 2048, texts of one length bucket), three rates in items/s:

- **model alone**: ``Embed.forward`` on tokens prepared once and already on the device — what
  the GPU can do with this model, the ceiling (budget: served >= 0.8x it at batch 512);
- **direct**: ``Embed.embed_texts`` in a tight loop in this process: tokenize, copy, model, copy
  back, one batch after the other, as a script would;
- **served**: ``queueserve worker bench.model_servings:BenchEmbed`` (one partition on the
  device, tokenizing in the preparation stage) saturated by ``client.map`` (budget: never below
  0.95x direct);
- **served, tokenized by the caller**: the same worker, with this process tokenizing each text
  as ``client.map`` sends it (``tasks.embed.CallerTokenizer``, what ``embed_tokens`` does
  through ``map_inputs``): the worker only collates.

The worker's metrics give the device thread's busy fraction (time in ``handle_batch`` over wall
time); on CUDA ``handle_batch`` returns once the work is queued, so ``served / model alone`` is
the GPU's own busy fraction, printed beside it. Without CUDA the GPU run is skipped (exit 0);
``--device cpu`` runs the same comparison on the CPU (served vs direct >= 1.0x there).

    python -m bench.gpu [--quick] [--json out.json] [--markdown out.md]
                        [--sizes 32,128,512,2048] [--bucket t128] [--dtype float16]
                        [--device cuda|cpu] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from ._harness import Rate, RedisServer, free_port, spawn_module, stop_process
from .model import _rate_json, bench_texts, served_rate
from .overlap import _busy_seconds

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PREFIX = "bg"


def _sync(model: Any) -> None:
    if model.cuda:
        model.torch.cuda.synchronize()


def model_alone_rate(model: Any, texts: list[str], batch: int) -> float:
    """Items/s of the forward pass on prepared, resident tokens (batches queued back to back,
    as the served device thread queues them)."""
    import queueserve as qs

    prepared = [
        model.prepare_batch(qs.Batch(texts[i : i + batch])) for i in range(0, len(texts), batch)
    ]
    model.forward(prepared[0])
    _sync(model)
    started = time.perf_counter()
    for tokens in prepared[1:]:
        model.forward(tokens)
    _sync(model)
    return (len(texts) - batch) / (time.perf_counter() - started)


def direct_rate(model: Any, texts: list[str], batch: int) -> float:
    model.embed_texts(texts[:batch])
    started = time.perf_counter()
    for i in range(batch, len(texts), batch):
        model.embed_texts(texts[i : i + batch])
    return (len(texts) - batch) / (time.perf_counter() - started)


def caller_tokenized_rate(client: Any, texts: list[str], batch: int) -> float:
    from tasks.embed import CallerTokenizer

    tokenize = CallerTokenizer()
    tokenize(texts[0])  # load the tokenizer outside the timed run
    marks: list[float] = []
    results = client.map(
        "embed_bench", (tokenize(t) for t in texts), chunk_size=batch, max_in_flight=8, timeout=600
    )
    for done, _ in enumerate(results, 1):
        if done == batch:
            marks.append(time.perf_counter())
    return (len(texts) - batch) / (time.perf_counter() - marks[0])


def run_size(
    url: str,
    device: str,
    batch: int,
    batches: int,
    reps: int,
    bucket: str,
    dtype: str,
    threads: int,
) -> dict[str, Any]:
    import queueserve as qs
    from tasks.embed import Embed

    texts = bench_texts(bucket, batches, batch)
    prefix = f"{PREFIX}{batch}"
    port = free_port()
    os.environ.update(
        QS_BENCH_THREADS=str(threads),
        QS_BENCH_BATCH=str(batch),
        QS_BENCH_URL=url,
        QS_BENCH_DTYPE=dtype,
    )
    worker = spawn_module(
        "queueserve",
        "worker",
        "bench.model_servings:BenchEmbed",
        "--redis-url",
        url,
        "--prefix",
        prefix,
        "--partitions",
        "1",
        "--metrics-port",
        str(port),
        "--log-level",
        "WARNING",
    )
    client = qs.Client(url, prefix=prefix)
    try:
        model = Embed(dtype=dtype)
        model.setup(qs.Partition(device=device))
        if device == "cpu":
            model.torch.set_num_threads(threads)
        client.dispatch_many("embed_bench", texts[:batch], timeout=600)  # worker warm
        alone, direct, served, caller, busy = [], [], [], [], []
        for _ in range(reps):
            alone.append(model_alone_rate(model, texts, batch))
            direct.append(direct_rate(model, texts, batch))
            busy0, _ = _busy_seconds(port, "embed_bench")
            started = time.perf_counter()
            served.append(served_rate(client, texts, batch))
            wall = time.perf_counter() - started
            busy.append((_busy_seconds(port, "embed_bench")[0] - busy0) / wall)
            caller.append(caller_tokenized_rate(client, texts, batch))
    finally:
        client.close()
        stop_process(worker, timeout=60)
    a, d, s, c = Rate(alone), Rate(direct), Rate(served), Rate(caller)
    return {
        "batch_size": batch,
        "bucket": bucket,
        "device": device,
        "dtype": dtype,
        "model_alone": _rate_json(a),
        "direct": _rate_json(d),
        "served": _rate_json(s),
        "served_caller_tokenized": _rate_json(c),
        "served_vs_alone": s.median / a.median,
        "served_vs_direct": s.median / d.median,
        "direct_vs_alone": d.median / a.median,
        "device_thread_busy": statistics.median(busy),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs (smoke test)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", help="write the results here as a Markdown table")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--sizes",
        default=None,
        help="batch sizes, comma-separated (default 32,128,512,2048 on cuda, 32 on cpu)",
    )
    parser.add_argument("--bucket", default="t128", help="length bucket of the texts")
    parser.add_argument(
        "--dtype", default=None, help="model dtype on cuda (default float16; cpu is float32)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads on cpu")
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench.gpu: skipped, no CUDA device is visible (run it on a GPU machine, or "
            "with --device cpu)"
        )
        sys.exit(0)
    dtype = "float32" if args.device == "cpu" else (args.dtype or "float16")
    default_sizes = "32,128,512,2048" if args.device == "cuda" else "32"
    sizes = [int(x) for x in (args.sizes or default_sizes).split(",")]
    reps = 2 if args.quick else 3
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else f"cpu x{os.cpu_count()}"
    print(f"device {name}, dtype {dtype}, {args.bucket} texts", flush=True)
    server = RedisServer().start()
    results = []
    try:
        for batch in sizes:
            # Enough batches for a steady state: about 20 on a GPU, fewer of the slow CPU ones.
            batches = (
                (6 if args.quick else 20) if args.device == "cuda" else (4 if args.quick else 10)
            )
            r = run_size(
                server.url, args.device, batch, batches, reps, args.bucket, dtype, args.threads
            )
            results.append(r)
            print(
                f"batch {batch:5d}  model alone {r['model_alone']['median']:9.1f}/s  direct "
                f"{r['direct']['median']:9.1f}/s  served {r['served']['median']:9.1f}/s  "
                f"served/alone {r['served_vs_alone']:.3f}  served/direct "
                f"{r['served_vs_direct']:.3f}  device thread busy "
                f"{r['device_thread_busy']:.2f}  served, caller tokenizes "
                f"{r['served_caller_tokenized']['median']:9.1f}/s",
                flush=True,
            )
            # Written after every size: a run cut short by its time limit keeps what it measured.
            write_results(args, name, dtype, reps, results)
    finally:
        server.stop()


def write_results(
    args: argparse.Namespace, device: str, dtype: str, reps: int, results: list[dict[str, Any]]
) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": device,
                    "dtype": dtype,
                    "results": results,
                    "loadavg": os.getloadavg(),
                    "cores": os.cpu_count(),
                },
                f,
                indent=2,
            )
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(device, dtype, args.bucket, reps, results))


def markdown_table(
    device: str, dtype: str, bucket: str, reps: int, results: list[dict[str, Any]]
) -> str:
    """The results as docs/benchmarks.md shows them: items/s medians, then the ratios."""
    lines = [
        f"MiniLM on {device}, {dtype}, {bucket} texts, median of {reps} runs "
        "(`python -m bench.gpu`):",
        "",
        "| batch | model alone /s | direct /s | served /s | served, caller tokenizes /s "
        "| served / alone | served / direct | device thread busy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['batch_size']} | {r['model_alone']['median']:,.0f} | "
            f"{r['direct']['median']:,.0f} | {r['served']['median']:,.0f} | "
            f"{r['served_caller_tokenized']['median']:,.0f} | {r['served_vs_alone']:.3f} | "
            f"{r['served_vs_direct']:.3f} | {r['device_thread_busy']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
