"""The one-command demo (``scripts/demo``): index the standard library's docstrings with a real
embedding model, triggered through Celery and batched by queueserve, then search them.

It starts, and stops again at the end:

1. Redis: ``$QUEUESERVE_REDIS_URL`` when set, else a private ``redis-server`` on a unix socket;
2. ``queueserve worker tasks.embed:embed`` with the MiniLM model in each partition (two 1-thread
   partitions by default: partitions x threads must not exceed the cores);
3. a Celery worker (solo pool) running ``tasks.index_corpus`` and ``tasks.search``.

Then it runs ``index_corpus`` and shows its PROGRESS states, prints the throughput, the sizes
of the batches the worker ran (from its Prometheus metrics) and the top hits of semantic
queries, shuts everything down gracefully and checks that no process it started is left.

    python -m tasks.demo [--limit 1200 | --all] [--query "..."] [--partitions 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

DEFAULT_LIMIT = 1200
QUERIES = [
    "how do I parse command-line arguments?",
    "read and write compressed archives",
    "measure how long a piece of code takes to run",
]
READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0  # well above the queueserve worker's --shutdown-timeout
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (from /proc), so the check at the end sees grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_bytes()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return state[state.rindex(b")") + 2 :][:1] != b"Z"  # a zombie has exited


class Processes:
    """Child processes, stopped in reverse start order, then checked: no child, grandchild or
    helper process may be left.

    A normal stop sends SIGTERM, graceful for both workers (Celery's warm shutdown waits for
    its running task). After an interrupt a process's ``urgent`` signal goes instead, so the
    Celery worker abandons the indexing task rather than finish it.
    """

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.started: list[tuple[str, subprocess.Popen[bytes], signal.Signals]] = []
        self.seen: set[int] = set()
        self.captured: dict[int, Path] = {}  # pid -> its output, shown only when it failed

    def start(
        self, name: str, *args: str, urgent: signal.Signals = signal.SIGTERM, capture: bool = False
    ) -> subprocess.Popen[bytes]:
        """``capture``: the process's output goes to a file, shown only if it fails (Celery
        prints "worker: Warm shutdown (MainProcess)" on every stop, whatever its log level)."""
        output = None
        if capture:
            path = self.logs / f"{len(self.started)}-{name.replace(' ', '-')}.log"
            output = path.open("wb")
        # Own process group: a Ctrl-C reaches the demo alone, which then stops these in order.
        try:
            proc = subprocess.Popen(
                [sys.executable, *args],
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                process_group=0,
                stdout=output,
                stderr=output,
            )
        finally:
            if output is not None:
                output.close()  # the child holds its own descriptor
        if capture:
            self.captured[proc.pid] = path
        self.started.append((name, proc, urgent))
        return proc

    def remember_tree(self) -> None:
        for _, proc, _ in self.started:
            self.seen.update([proc.pid, *_descendants(proc.pid)])

    def stop(self, urgent: bool = False) -> list[str]:
        """Stop all; returns problems (non-zero exits of a normal stop, processes left)."""
        self.remember_tree()
        problems = []
        for name, proc, urgent_signal in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(urgent_signal if urgent else signal.SIGTERM)
            try:
                code = proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its group: partitions included
                code = proc.wait()
                problems.append(f"{name} did not stop within {STOP_TIMEOUT_S:g}s; killed")
            if code != 0 and not urgent:
                problems.append(f"{name} exited with code {code}{self._output_of(proc)}")
        deadline = time.monotonic() + 10  # helpers (multiprocessing's tracker) exit just after
        left = [p for p in self.seen if _alive(p)]
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = [p for p in left if _alive(p)]
        if left:
            problems.append(f"processes still running: {sorted(left)}")
        return problems

    def _output_of(self, proc: subprocess.Popen[bytes]) -> str:
        path = self.captured.get(proc.pid)
        if path is None or not path.exists():
            return ""
        tail = path.read_text(errors="replace").splitlines()[-20:]
        return "; its output ended:\n" + "\n".join(f"    {line}" for line in tail)


def _redis(stack: contextlib.ExitStack) -> str:
    url = os.environ.get("QUEUESERVE_REDIS_URL")
    if url:
        print(f"Redis: {url} (QUEUESERVE_REDIS_URL)")
        return url
    from queueserve.broker.embedded import EmbeddedRedis

    url = stack.enter_context(EmbeddedRedis())
    print(f"Redis: started a private redis-server at {url}")
    return url


def _wait_ready(port: int, worker: subprocess.Popen[bytes]) -> float:
    """Seconds until the worker's /readyz says every partition loaded the model."""
    started = time.monotonic()
    while time.monotonic() - started < READY_TIMEOUT_S:
        if worker.poll() is not None:
            raise RuntimeError(f"the queueserve worker exited with code {worker.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the queueserve worker was not ready after {READY_TIMEOUT_S:g}s")


def _show_progress(result: Any, limit_s: float) -> dict[str, Any]:
    """Print the task's PROGRESS states until it finishes; returns its result. On a terminal
    one line is redrawn; otherwise a line is printed when done has moved, at most every 5s."""
    tty = sys.stdout.isatty()
    deadline = time.monotonic() + limit_s
    printed_at, printed_done = 0.0, -1
    while not result.ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"indexing did not finish within {limit_s:g}s")
        info = result.info
        if result.state == "PROGRESS" and isinstance(info, dict):
            line = progress_line(info["done"], info["total"], info["items_per_s"])
            if tty:
                print(f"\r{line}", end="", flush=True)
            elif info["done"] != printed_done and time.monotonic() - printed_at >= 5:
                print(line, flush=True)
                printed_at, printed_done = time.monotonic(), info["done"]
        time.sleep(0.3)
    summary: dict[str, Any] = result.get(timeout=30)
    # The last PROGRESS state seen may be seconds old (sampled, printed at most every 5s):
    # end on the total, so the count never stops short of what "indexed N" then reports.
    final = progress_line(summary["count"], summary["count"], summary["items_per_s"])
    print(f"\r{final}" if tty else final, flush=True)
    return summary


def progress_line(done: int, total: int, per_s: float) -> str:
    return f"  PROGRESS {done:>5}/{total} passages, {per_s:6.1f}/s"


def batch_sizes(metrics_text: str) -> dict[str, list[tuple[float, float]]]:
    """Per batch key, the cumulative (le, count) buckets of ``queueserve_batch_size``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "queueserve_batch_size":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("serving") == "embed":
                le = float(sample.labels["le"])
                out.setdefault(sample.labels["key"], []).append((le, sample.value))
    return {k: sorted(v) for k, v in out.items()}


def size_histogram(per_key: dict[str, list[tuple[float, float]]]) -> list[tuple[str, int]]:
    """(size range, batches) over all keys, from cumulative buckets; empty tail ranges left out."""
    cumulative: dict[float, float] = {}
    for buckets in per_key.values():
        for le, count in buckets:
            cumulative[le] = cumulative.get(le, 0.0) + count
    rows: list[tuple[str, int]] = []
    prev_le, prev = 0.0, 0.0
    for le in sorted(cumulative):
        lo = int(prev_le) + 1
        label = (
            f">{int(prev_le)}"
            if le == float("inf")
            else (str(int(le)) if lo == int(le) else f"{lo}-{int(le)}")
        )
        rows.append((label, int(cumulative[le] - prev)))
        prev_le, prev = le, cumulative[le]
    while rows and rows[-1][1] == 0:
        rows.pop()
    return rows


def _print_batch_sizes(port: int, capacity: int) -> None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            per_key = batch_sizes(r.read().decode())
    except (urllib.error.URLError, OSError) as e:
        print(f"batch sizes: metrics unavailable ({e})")
        return
    rows = size_histogram(per_key)
    total = sum(n for _, n in rows)
    print(f"batch sizes ({total} batches, capacity {capacity}; from the worker's metrics):")
    widest = max((n for _, n in rows), default=1) or 1
    for label, n in rows:
        print(f"  {label:>7} items {n:5d}  {'#' * round(40 * n / widest)}")
    by_key = ", ".join(
        f"{key} {int(buckets[-1][1])}"
        for key, buckets in sorted(per_key.items(), key=lambda kv: (len(kv[0]), kv[0]))
    )
    print(f"  batches per length bucket: {by_key}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/demo",
        description="Index the Python standard library's docstrings with a real embedding model "
        "(Celery triggers it, queueserve batches it), then search them.",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--limit",
        type=int,
        default=DEFAULT_LIMIT,
        help=f"passages to index, taken across all modules (default {DEFAULT_LIMIT})",
    )
    size.add_argument("--all", action="store_true", help="index every passage (about 5,400)")
    parser.add_argument("--query", action="append", help="query to search (repeatable)")
    parser.add_argument("-k", type=int, default=3, help="hits per query (default 3)")
    parser.add_argument(
        "--partitions",
        type=int,
        default=2,
        help="queueserve partitions; each gets cores / partitions torch threads",
    )
    return parser.parse_args(argv)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through the cleanup below


def demo_index_dir(stack: contextlib.ExitStack) -> str:
    """Where the demo's Celery worker writes its index (EMBED_INDEX_DIR): a temporary directory
    that ``stack`` removes, so a run leaves nothing in the checkout. (The tasks' own default,
    ``./.index``, is git-ignored for those who run them from the checkout.)"""
    return stack.enter_context(tempfile.TemporaryDirectory(prefix="qs-demo-index-"))


def run(args: argparse.Namespace, stack: contextlib.ExitStack, problems: list[str]) -> None:
    """The demo; shutdown problems (exit codes, processes left) are added to ``problems``."""
    url = _redis(stack)
    given_prefix = os.environ.get("QUEUESERVE_PREFIX")
    prefix = given_prefix or f"demo-{os.getpid()}"
    index_dir = demo_index_dir(stack)
    # Set here, before the Celery app is first used: it reads them (tasks.celery_app).
    os.environ.update(
        QUEUESERVE_REDIS_URL=url,
        QUEUESERVE_PREFIX=prefix,
        HF_HUB_OFFLINE="1",
        EMBED_INDEX_DIR=index_dir,
    )
    if not given_prefix:
        stack.callback(_delete_keys, url, prefix)
    port = _free_port()
    logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="qs-demo-logs-")))
    procs = Processes(dict(os.environ, PYTHONUNBUFFERED="1"), logs)
    stack.push(lambda exc_type, *_: problems.extend(procs.stop(urgent=exc_type is not None)))
    worker = procs.start(
        "queueserve worker",
        "-m",
        "queueserve",
        "worker",
        "tasks.embed:embed",
        "--partitions",
        str(args.partitions),
        "--metrics-port",
        str(port),
        # Idle at a normal stop; after an interrupt, held batches get 10s to be answered.
        "--shutdown-timeout",
        "10s",
        "--log-level",
        "WARNING",
    )
    procs.start(
        # Celery warns at length when run as root (containers, CI); the demo is not the place.
        "celery worker",
        "-W",
        "ignore:You're running the worker with superuser privileges",
        "-m",
        "celery",
        "--quiet",
        "-A",
        "tasks.celery_app",
        "worker",
        "--pool",
        "solo",
        "--loglevel",
        "WARNING",
        "--hostname",
        f"demo-{os.getpid()}@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        # After an interrupt: a solo pool cannot cancel its running task (a cold shutdown
        # raises NotImplementedError into it), and the task's message is acked already.
        urgent=signal.SIGKILL,
        capture=True,
    )
    print(
        f"started queueserve worker ({args.partitions} partitions, metrics on :{port}) and "
        "a Celery worker; loading the model ...",
        flush=True,
    )
    print(f"model loaded in every partition after {_wait_ready(port, worker):.1f}s")
    procs.remember_tree()
    try:
        _index_and_search(args, port)
    except BaseException as e:
        # Drop the Celery results in the unwound frames now, while Redis is still up: their
        # __del__ talks to the result backend.
        traceback.clear_frames(e.__traceback__)
        raise


def _index_and_search(args: argparse.Namespace, port: int) -> None:
    from tasks.celery_app import index_corpus, search
    from tasks.embed import Embed

    limit = None if args.all else args.limit
    print(
        f"indexing {'all' if limit is None else limit} stdlib docstring passages through "
        "Celery -> queueserve ...",
        flush=True,
    )
    summary = _show_progress(index_corpus.apply_async(kwargs={"limit": limit}), 1800)
    buckets = sorted(summary["buckets"].items(), key=lambda kv: (len(kv[0]), kv[0]))
    print(
        f"indexed {summary['count']} passages in {summary['seconds']:.1f}s: "
        f"{summary['items_per_s']:.1f} passages/s with {args.partitions} partitions"
    )
    print(f"  passages per length bucket (batch key): {', '.join(f'{k} {n}' for k, n in buckets)}")
    _print_batch_sizes(port, Embed.batch_size)
    for query in args.query or QUERIES:
        hits = search.apply_async(args=(query,), kwargs={"k": args.k}).get(timeout=120)
        print(f"\nsearch: {query!r}")
        for pid, score, text in hits:
            print(f"  {score:.3f}  {pid:<36} {text[:90]}{'...' if len(text) > 90 else ''}")
    print()


def _delete_keys(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    except redis.RedisError as e:
        print(f"could not delete the demo's keys under {prefix}: {e}", file=sys.stderr)
    finally:
        client.close()


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    problems: list[str] = []
    code = 0
    try:
        with _sigterm_as_interrupt(), contextlib.ExitStack() as stack:
            run(args, stack, problems)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        code = 130
    except Exception as e:
        print(f"demo failed: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    for problem in problems:
        print(f"shutdown problem: {problem}", file=sys.stderr)
    if not problems:
        print(
            f"stopped everything it started, no process left behind "
            f"(the demo took {time.monotonic() - started:.0f}s)"
        )
    return code or (1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
