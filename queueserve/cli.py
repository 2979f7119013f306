"""``queueserve``: the command line. Only this module configures logging.

Exit codes: 0 ok (also after a graceful SIGTERM/SIGINT), 1 error (a --check found no live
worker, Redis unreachable), 2 usage (bad arguments, a module:attr that does not load), 3 forced
stop (a second signal), 4 crash loop (a partition died more than --max-restarts times within
--restart-window).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ._durations import parse_duration
from .broker import RedisBroker
from .deadletter import DeadLetters
from .errors import QueueServeError
from .loading import ServingNotFound, load_servings
from .protocol import Keys
from .runtime_config import OPTIONS, parse_assignments
from .serving import Serving
from .settings import Settings
from .stats import stats_command
from .worker import EXIT_ERROR, EXIT_OK, EXIT_USAGE, Worker

log = logging.getLogger("queueserve.cli")


def _duration(value: str) -> float:
    try:
        return parse_duration(value)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _partitions(value: str) -> int | str:
    if value == "auto":
        return value
    return _positive_int(value)


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="queueserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="serve one or more servings")
    w.add_argument("servings", nargs="+", metavar="module:attr")
    w.add_argument("--redis-url", help="Redis URL (default: $QUEUESERVE_REDIS_URL)")
    w.add_argument("--prefix", help="key prefix (default: $QUEUESERVE_PREFIX or qs)")
    w.add_argument("--partitions", type=_partitions, default="auto",
                   help="'auto' (one per visible CUDA device, else 1) or a number (default auto)")
    w.add_argument("--batch-size", type=_positive_int, help="override every serving's batch_size")
    w.add_argument("--batch-timeout", type=_duration, help="override batch_timeout, e.g. 10ms")
    w.add_argument("--batch-key", action="append", default=[], dest="batch_keys",
                   help="batch key to consume from the start (repeatable); others are found")
    w.add_argument("--max-concurrent-batches", type=_positive_int, default=1,
                   help="batches prefetched while one executes (default 1)")
    w.add_argument("--shutdown-timeout", type=_duration, default=30.0,
                   help="how long SIGTERM may take to finish held work (default 30s)")
    w.add_argument("--max-restarts", type=_positive_int, default=5,
                   help="partition deaths tolerated within --restart-window (default 5)")
    w.add_argument("--restart-window", type=_duration, default=60.0,
                   help="window for --max-restarts (default 60s)")
    w.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics, /healthz and /readyz on this port")
    w.add_argument("--check", action="store_true",
                   help="exit 0 when a live worker serves every named serving, else 1")
    w.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    d = sub.add_parser("dead-letter", help="list, replay or drop a serving's dead letters")
    d.add_argument("action", choices=["list", "replay", "drop"])
    d.add_argument("serving")
    d.add_argument("ids", nargs="*", help="dead-letter ids (replay/drop); none with --all")
    d.add_argument("--all", action="store_true", help="replay or drop every dead letter")
    d.add_argument("--limit", type=_positive_int, default=100, help="how many to list")
    d.add_argument("--redis-url", help="Redis URL (default: $QUEUESERVE_REDIS_URL)")
    d.add_argument("--prefix", help="key prefix (default: $QUEUESERVE_PREFIX or qs)")
    d.add_argument("--log-level", default="WARNING")
    c = sub.add_parser("config", help="show or change a serving's options at run time")
    c.add_argument("action", choices=["get", "set"])
    c.add_argument("serving")
    c.add_argument("assignments", nargs="*", metavar="option=value",
                   help=f"with set: {', '.join(OPTIONS)}")
    s = sub.add_parser("stats", help="queues, consumers, lag, throughput and dead letters")
    s.add_argument("servings", nargs="*", help="servings to show (default: all found)")
    s.add_argument("--interval", type=_duration, default=1.0,
                   help="how long to sample throughput (default 1s)")
    for p in (c, s):
        p.add_argument("--redis-url", help="Redis URL (default: $QUEUESERVE_REDIS_URL)")
        p.add_argument("--prefix", help="key prefix (default: $QUEUESERVE_PREFIX or qs)")
        p.add_argument("--log-level", default="WARNING")
    return parser


def config_command(args: argparse.Namespace) -> int:
    settings = Settings()
    broker = RedisBroker(args.redis_url or settings.redis_url)
    keys = Keys(args.prefix or settings.prefix, args.serving)
    try:
        if args.action == "set":
            if not args.assignments:
                print("queueserve: config set takes option=value pairs", file=sys.stderr)
                return EXIT_USAGE
            broker.set_config(keys, parse_assignments(args.assignments))
        overrides = broker.config(keys)
        for name, value in sorted(broker.meta(keys).items()):
            mark = "  (set at run time)" if name in overrides else ""
            print(f"{name} = {value}{mark}")
        return EXIT_OK
    finally:
        broker.close()


def dead_letter_command(args: argparse.Namespace) -> int:
    settings = Settings()
    broker = RedisBroker(args.redis_url or settings.redis_url)
    letters = DeadLetters(broker, args.prefix or settings.prefix, args.serving)
    try:
        if args.action == "list":
            for r in letters.records(args.limit):
                print(f"{r.id}  from {r.stream} {r.entry_id}  deliveries={r.deliveries}  "
                      f"{r.reason}")
            return EXIT_OK
        if bool(args.ids) == args.all:
            print(f"queueserve: {args.action} takes dead-letter ids or --all", file=sys.stderr)
            return EXIT_USAGE
        ids = [r.id for r in letters.records(10**9)] if args.all else args.ids
        for dead_id in ids:
            if args.action == "replay":
                print(f"{dead_id} replayed as {letters.replay(dead_id)}")
            elif letters.drop(dead_id):
                print(f"{dead_id} dropped")
            else:
                print(f"{dead_id}: no such dead letter", file=sys.stderr)
                return EXIT_ERROR
        return EXIT_OK
    except (KeyError, ValueError) as e:
        print(f"queueserve: {e}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        broker.close()


def _check(servings: Sequence[Serving], url: str, prefix: str) -> int:
    broker = RedisBroker(url)
    try:
        missing = [s.name for s in servings if broker.alive_workers(Keys(prefix, s.name), 10) == 0]
    finally:
        broker.close()
    if missing:
        print(f"no live worker for: {', '.join(missing)}", file=sys.stderr)
        return EXIT_ERROR
    print("ok")
    return EXIT_OK


def worker_command(args: argparse.Namespace) -> int:
    settings = Settings()
    url = args.redis_url or settings.redis_url
    prefix = args.prefix or settings.prefix
    if args.check:
        return _check([s for spec in args.servings for s in load_servings(spec)], url, prefix)
    worker = Worker(
        args.servings, redis_url=url, prefix=prefix, partitions=args.partitions,
        batch_size=args.batch_size, batch_timeout=args.batch_timeout, batch_keys=args.batch_keys,
        max_concurrent_batches=args.max_concurrent_batches,
        shutdown_timeout=args.shutdown_timeout, max_restarts=args.max_restarts,
        restart_window=args.restart_window, metrics_port=args.metrics_port,
    )
    return worker.run()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s",
    )
    try:
        if args.command == "dead-letter":
            return dead_letter_command(args)
        if args.command == "config":
            return config_command(args)
        if args.command == "stats":
            return stats_command(args)
        return worker_command(args)
    except ServingNotFound as e:
        print(f"queueserve: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (QueueServeError, ValueError, TypeError) as e:
        print(f"queueserve: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
