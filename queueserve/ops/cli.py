"""``queueserve``: the command line. Only this module configures logging.

Exit codes are listed in EPILOG (what ``queueserve --help`` shows) and docs/operations.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from pydantic import ValidationError

from queueserve.broker.admin import Admin
from queueserve.errors import QueueServeError
from queueserve.ops.admin_commands import (
    config_command,
    dead_letter_command,
    servings_command,
    unknown_servings,
)
from queueserve.ops.job_commands import add_job_parser, job_command
from queueserve.ops.server_flags import add_server_options, server_options
from queueserve.ops.stats import stats_command
from queueserve.options.servers import DashboardOptions, GatewayOptions
from queueserve.options.stored import OPTIONS
from queueserve.options.units import parse_duration, problem
from queueserve.serving import Serving
from queueserve.settings import Settings, check_prefix, check_redis_url
from queueserve.wire.keys import Keys
from queueserve.wire.timing import ALIVE_WITHIN_S
from queueserve.worker import logs
from queueserve.worker.loading import ServingNotFound, load_servings
from queueserve.worker.options import ENV_PREFIX, WorkerOptions, option_from_text, unknown_variables
from queueserve.worker.worker import EXIT_ERROR, EXIT_OK, EXIT_USAGE, Worker, require_extras

log = logging.getLogger("queueserve.cli")

DESCRIPTION = """\
queueserve batches work from many producers over Redis Streams. Run a worker for your
servings, then call them from any process with qs.Client (see README.md):

  queueserve worker myapp.servings:serving --redis-url redis://localhost:6379/0

module:attr is imported from the current directory (or PYTHONPATH), as `python -c` would."""

EPILOG = """\
environment: QUEUESERVE_REDIS_URL (default redis://127.0.0.1:6379/0), QUEUESERVE_PREFIX
(default qs), QUEUESERVE_DEFAULT_TIMEOUT (clients: bound calls made without timeout=), and
each worker option as QUEUESERVE_<NAME> (QUEUESERVE_BATCH_SIZE=64; a flag wins). Every
variable is listed in docs/operations.md; a misspelled one is a usage error.

exit codes: 0 ok or stopped by SIGTERM/SIGINT; 1 error (Redis unreachable at start, a
serving's setup() failed, --check found no live worker, an unknown serving); 2 usage (bad
arguments or Redis URL, a module:attr that does not load); 3 forced stop (a second signal);
4 crash loop (a partition died more than --max-restarts times within --restart-window);
5 `job wait`: the job failed (its JSON holds each item's result or error).
Each error is explained in docs/troubleshooting.md."""

DEFAULT_URL = Settings.model_fields["redis_url"].default
URL_HELP = f"Redis URL (default: $QUEUESERVE_REDIS_URL, else {DEFAULT_URL})"
PREFIX_HELP = "key prefix (default: $QUEUESERVE_PREFIX, else qs)"


def _cwd_on_path() -> None:
    """Import ``module:attr`` from the current directory, as celery, rq, arq and uvicorn do.
    Partition processes inherit sys.path (spawn sends the parent's along)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _duration(value: str) -> float:
    try:
        return parse_duration(value)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_duration(value: str) -> float:
    seconds = _duration(value)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 (for example 1s), got {value!r}")
    return seconds


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")
    return int(value)


def _worker_option(name: str) -> Callable[[str], object]:
    def parse(text: str) -> object:
        try:
            return option_from_text(name, text)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = name
    return parse


def _add_worker_options(w: argparse.ArgumentParser) -> None:
    """A flag per WorkerOptions field; a flag left out is absent from the namespace, so its
    QUEUESERVE_<NAME> variable or default applies (WorkerOptions.of)."""
    for name, field in WorkerOptions.model_fields.items():
        default = field.default if field.default not in (None, ()) else "none"
        if isinstance(default, float):
            default = f"{default:g}s"
        more = f" (default {default}; env {ENV_PREFIX}{name.upper()})"
        if name == "batch_keys":
            w.add_argument(
                "--batch-key",
                action="append",
                dest=name,
                default=argparse.SUPPRESS,
                metavar="KEY",
                help=f"{field.description}{more}",
            )
            continue
        w.add_argument(
            f"--{name.replace('_', '-')}",
            type=_worker_option(name),
            default=argparse.SUPPRESS,
            metavar=name.upper(),
            help=f"{field.description}{more}",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="queueserve",
        description=DESCRIPTION,
        epilog=EPILOG,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="serve one or more servings", allow_abbrev=False)
    w.add_argument("servings", nargs="+", metavar="module:attr")
    w.add_argument("--redis-url", help=URL_HELP)
    w.add_argument("--prefix", help=PREFIX_HELP)
    _add_worker_options(w)
    w.add_argument(
        "--check",
        action="store_true",
        help="exit 0 when a live worker serves every named serving, else 1",
    )
    d = sub.add_parser("dead-letter", help="list, replay or drop a serving's dead letters")
    d.add_argument("action", choices=["list", "replay", "drop"])
    # nargs="?"/"*" positionals: argparse would list a plain one as "required" even for list.
    d.add_argument(
        "serving",
        nargs="?",
        help="the serving (list: default every serving; replay/drop: required)",
    )
    d.add_argument(
        "ids", nargs="*", metavar="ID", help="dead-letter ids to replay or drop; or --all"
    )
    d.add_argument("--all", action="store_true", help="replay or drop every dead letter")
    d.add_argument("--limit", type=_positive_int, default=100, help="how many to list")
    c = sub.add_parser("config", help="show or change a serving's options at run time")
    c.add_argument("action", choices=["get", "set"])
    c.add_argument(
        "serving", nargs="?", help="the serving (get: default every serving; set: required)"
    )
    c.add_argument(
        "assignments", nargs="*", metavar="option=value", help=f"with set: {', '.join(OPTIONS)}"
    )
    c.add_argument(
        "--force", action="store_true", help="set options of a serving no worker has declared yet"
    )
    v = sub.add_parser(
        "servings", help="the servings workers list (the registry: P:servings), by name"
    )
    v.add_argument(
        "--rebuild",
        action="store_true",
        help="first list there every serving a SCAN finds declared (workers before the registry)",
    )
    s = sub.add_parser("stats", help="queues, consumers, lag, throughput and dead letters")
    s.add_argument("servings", nargs="*", help="servings to show (default: all found)")
    s.add_argument(
        "--interval",
        type=_positive_duration,
        default=1.0,
        help="how long to sample throughput (default 1s)",
    )
    g = sub.add_parser(
        "gateway",
        help="serve HTTP (JSON, SSE, OpenAI API) in front of servings "
        "(the gateway extra; docs/gateway.md)",
    )
    add_server_options(g, GatewayOptions)
    b = sub.add_parser(
        "dashboard",
        help="a web page of servings, workers, queues and dead letters "
        "(the dashboard extra; docs/operations.md)",
    )
    add_server_options(b, DashboardOptions)
    for p in (d, c, s, g, b, v):
        p.add_argument("--redis-url", help=URL_HELP)
        p.add_argument("--prefix", help=PREFIX_HELP)
    for p in (d, c, s, v):  # the servers' is an option of theirs (INFO: they say where they listen)
        p.add_argument("--log-level", default="WARNING")
    add_job_parser(sub, URL_HELP, PREFIX_HELP)
    return parser


def _check(servings: Sequence[Serving], url: str, prefix: str) -> int:
    broker = Admin(url)
    try:
        missing = [
            s.name
            for s in servings
            if broker.alive_workers(Keys(prefix, s.name), ALIVE_WITHIN_S) == 0
        ]
    finally:
        broker.close()
    if missing:
        print(f"no live worker for: {', '.join(missing)}", file=sys.stderr)
        return EXIT_ERROR
    print("ok")
    return EXIT_OK


def worker_command(args: argparse.Namespace) -> int:
    if args.check:
        settings = Settings()
        url = args.redis_url or settings.redis_url
        prefix = args.prefix or settings.prefix
        return _check([s for spec in args.servings for s in load_servings(spec)], url, prefix)
    flags = {n: getattr(args, n) for n in WorkerOptions.model_fields if hasattr(args, n)}
    options = WorkerOptions.of(flags)  # the flags win over QUEUESERVE_* variables
    try:
        require_extras(options)
    except ImportError as e:
        print(f"queueserve: {e}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure(options.log_level, options.log_format)
    # redis_url/prefix None: the worker takes the setting, and logs where its Redis came from
    worker = Worker(args.servings, redis_url=args.redis_url, prefix=args.prefix, **dict(options))
    return worker.run()


def stats_or_unknown(args: argparse.Namespace) -> int:
    if args.servings:
        settings = Settings()
        prefix = args.prefix or settings.prefix
        broker = Admin(args.redis_url or settings.redis_url)
        try:
            problem = unknown_servings(broker, prefix, args.servings)
        finally:
            broker.close()
        if problem is not None:
            print(f"queueserve: {problem}", file=sys.stderr)
            return EXIT_ERROR
    return stats_command(args)


def gateway_command(args: argparse.Namespace) -> int:
    try:  # the gateway extra is optional: the rest of the CLI works without it
        from queueserve.gateway.serve import serve_gateway
    except ImportError as e:
        print(
            f"queueserve: the gateway needs the gateway extra ({e}); "
            "pip install 'queueserve[gateway]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return serve_gateway(args.options, args.redis_url, args.prefix, args.token is not None)


def dashboard_command(args: argparse.Namespace) -> int:
    try:  # the dashboard extra is optional, like the gateway's
        from queueserve.dashboard.serve import serve_dashboard
    except ImportError as e:
        print(
            f"queueserve: the dashboard needs the dashboard extra ({e}); "
            "pip install 'queueserve[dashboard]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return serve_dashboard(args.options, args.redis_url, args.prefix)


def _check_environment(command: str) -> None:
    """A misspelled QUEUESERVE_* variable is a ValueError (its option would silently keep
    its default); one unknown otherwise is said, and left to whoever reads it."""
    misspelled, unknown = unknown_variables()
    if misspelled:
        raise ValueError("; ".join(misspelled))
    if unknown:
        log.warning(
            "ignoring %s: no queueserve variable (docs/operations.md lists them)",
            ", ".join(unknown),
        )
    if command == "worker":
        WorkerOptions.of({})


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "dead-letter": dead_letter_command,
    "config": config_command,
    "stats": stats_or_unknown,
    "servings": servings_command,
    "job": job_command,
    "gateway": gateway_command,
    "dashboard": dashboard_command,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure((getattr(args, "log_level", None) or "INFO").upper())  # servers: below
    _cwd_on_path()
    try:
        if args.redis_url is not None:
            check_redis_url(args.redis_url)
        if getattr(args, "prefix", None):
            check_prefix(args.prefix)
        # a bad QUEUESERVE_* variable is a usage error, said before anything starts
        Settings()
        _check_environment(args.command)
        args.options = server_options(args)
        if args.options is not None:
            logs.configure(args.options.log_level)
    except ValidationError as e:
        print(f"queueserve: {problem(e)}", file=sys.stderr)  # one line, no value echoed
        return EXIT_USAGE
    except ValueError as e:
        print(f"queueserve: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return COMMANDS.get(args.command, worker_command)(args)
    except ServingNotFound as e:
        print(f"queueserve: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (QueueServeError, ValueError, TypeError) as e:
        print(f"queueserve: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
