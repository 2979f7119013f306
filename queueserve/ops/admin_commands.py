"""The operators' commands that read and change a serving's state in Redis: ``config get|set``
and ``dead-letter list|replay|drop`` (``queueserve --help``; docs/operations.md)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from queueserve.broker.admin import Admin
from queueserve.broker.urls import redact_url
from queueserve.ops.deadletter import DeadLetters
from queueserve.options.stored import parse_assignments
from queueserve.settings import Settings
from queueserve.wire.keys import Keys, is_serving_name
from queueserve.worker.worker import EXIT_ERROR, EXIT_OK, EXIT_USAGE


def unknown_servings(broker: Admin, prefix: str, names: Sequence[str]) -> str | None:
    """An error message when a name in ``names`` was never declared by a worker under
    ``prefix`` (a typo, or another --prefix or Redis); None when all are known. Each name is
    checked by its own declaration (its meta hash), so a serving that the registry does not
    list (its workers predate it) is known too; the message lists the registry's."""
    valid = [n for n in names if is_serving_name(n)]
    declared = dict(zip(valid, broker.declared([Keys(prefix, n) for n in valid]), strict=True))
    missing = [n for n in names if not declared.get(n)]
    if not missing:
        return None
    known = broker.servings(prefix)
    listed = ", ".join(known) if known else "none yet (start a worker first)"
    return (
        f"no worker has declared serving {', '.join(map(repr, missing))} under prefix "
        f"{prefix!r} on Redis {redact_url(broker.url)}; known servings: {listed}. "
        "Check the name, --prefix and --redis-url"
    )


def config_command(args: argparse.Namespace) -> int:
    if args.action == "set" and (args.serving is None or not args.assignments):
        print(
            "queueserve: config set takes a serving and option=value pairs, e.g. "
            "`queueserve config set square batch_size=64`",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.action == "get" and args.assignments:
        print(
            "queueserve: config get takes only a serving; use config set to change options",
            file=sys.stderr,
        )
        return EXIT_USAGE
    assignments = parse_assignments(args.assignments) if args.action == "set" else {}
    settings = Settings()
    prefix = args.prefix or settings.prefix
    broker = Admin(args.redis_url or settings.redis_url)
    try:
        names = [args.serving] if args.serving is not None else broker.servings(prefix)
        if not names:
            print(f"no servings under prefix {prefix!r} on Redis {redact_url(broker.url)}")
            return EXIT_OK
        if not (args.action == "set" and args.force):
            problem = unknown_servings(broker, prefix, names)
            if problem is not None:
                hint = (
                    " (or pass --force to set it before any worker runs)"
                    if args.action == "set"
                    else ""
                )
                print(f"queueserve: {problem}{hint}", file=sys.stderr)
                return EXIT_ERROR
        for name in names:
            keys = Keys(prefix, name)
            if args.action == "set":
                broker.set_config(keys, assignments)
            if args.serving is None:
                print(f"[{name}]")
            overrides = broker.config(keys)
            for option, value in sorted(broker.meta(keys).items()):
                mark = "  (set at run time)" if option in overrides else ""
                print(f"{option} = {value}{mark}")
        return EXIT_OK
    finally:
        broker.close()


def dead_letter_command(args: argparse.Namespace) -> int:
    if args.action != "list" and args.serving is None:
        print(
            f"queueserve: dead-letter {args.action} takes a serving and ids (or --all), e.g. "
            f"`queueserve dead-letter {args.action} square --all`",
            file=sys.stderr,
        )
        return EXIT_USAGE
    settings = Settings()
    prefix = args.prefix or settings.prefix
    broker = Admin(args.redis_url or settings.redis_url)
    try:
        if args.serving is not None:
            problem = unknown_servings(broker, prefix, [args.serving])
            if problem is not None:
                print(f"queueserve: {problem}", file=sys.stderr)
                return EXIT_ERROR
        if args.action == "list":
            return _list_dead_letters(broker, prefix, args.serving, args.limit)
        letters = DeadLetters(broker, prefix, args.serving)
        if bool(args.ids) == args.all:
            print(f"queueserve: {args.action} takes dead-letter ids or --all", file=sys.stderr)
            return EXIT_USAGE
        if args.action == "replay":
            return _replay_dead_letters(letters, args.ids, args.all)
        ids = [r.id for r in letters.each()] if args.all else args.ids
        for dead_id in ids:
            if letters.drop(dead_id):
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


def _replay_dead_letters(letters: DeadLetters, ids: list[str], every: bool) -> int:
    """Replay each record; one that cannot be replayed is said on stderr and kept, and the
    rest go on (a forged record stops nothing). EXIT_ERROR when any was refused."""
    refused = 0
    for dead_id, outcome in letters.replay_each((r.id for r in letters.each()) if every else ids):
        if isinstance(outcome, Exception):
            refused += 1
            print(f"queueserve: {outcome.args[0] if outcome.args else outcome}", file=sys.stderr)
        else:
            print(f"{dead_id} replayed as {', '.join(outcome)}")
    return EXIT_ERROR if refused else EXIT_OK


def _list_dead_letters(broker: Admin, prefix: str, serving: str | None, limit: int) -> int:
    names = [serving] if serving is not None else broker.servings(prefix)
    shown = 0
    for name in names:
        for r in DeadLetters(broker, prefix, name).records(limit):
            shown += 1
            column = "" if serving is not None else f"{name}  "
            print(
                f"{column}{r.id}  from {r.stream} {r.entry_id}  deliveries={r.deliveries}  "
                f"{r.reason}"
            )
    if not shown:  # said on stderr: stdout stays a list a script can read (empty)
        where = (
            f"serving {serving!r}"
            if serving is not None
            else f"any serving under prefix {prefix!r}"
        )
        print(f"no dead letters for {where}", file=sys.stderr)
    return EXIT_OK


def servings_command(args: argparse.Namespace) -> int:
    """``queueserve servings [--rebuild]``: the servings registry (P:servings) with when a
    worker last declared each or beat for it; ``--rebuild`` first lists there every serving
    whose declaration a SCAN of the keyspace finds (workers that predate the registry)."""
    settings = Settings()
    prefix = args.prefix or settings.prefix
    broker = Admin(args.redis_url or settings.redis_url)
    try:
        if args.rebuild:
            found = broker.rebuild_listing(prefix)
            print(f"listed {len(found)} declared servings found by a scan", file=sys.stderr)
        listed, total = broker.listing(prefix)
        now_ms = int(time.time() * 1000)
        for name in sorted(listed):
            print(f"{name}  refreshed {max(0, now_ms - listed[name]) / 1000:.1f}s ago")
        if total > len(listed):
            print(f"... and {total - len(listed)} more (not read)", file=sys.stderr)
        if not listed:
            print(
                f"no servings listed under prefix {prefix!r} on Redis {redact_url(broker.url)} "
                "(workers before the registry: `queueserve servings --rebuild`)",
                file=sys.stderr,
            )
        return EXIT_OK
    finally:
        broker.close()
