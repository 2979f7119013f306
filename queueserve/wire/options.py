"""Serving options as stored in Redis: the one model of every value of ``P:{S}:config`` (set
at run time, ``queueserve config set``) and of the options clients act on in ``P:{S}:meta``.

Both hashes are written by whoever can write to Redis, so every value read from them goes
through the rules (and bounds) of ``qs.Serving`` here: ``config set`` refuses what a worker
would refuse, with the same message, and a worker or client that reads a value the model
refuses logs it and goes on without it (docs/guarantees.md, "Values read from Redis").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from queueserve.serving import (
    MAX_BATCH_TIMEOUT_S,
    MAX_DELIVERIES,
    MAX_KEY_IDLE_TTL_S,
    MAX_PAYLOAD_BYTES,
    _check_batch_size,
    _check_duration,
    _check_max_queue,
    _check_positive,
    _check_reply_bytes,
)
from queueserve.wire.protocol import Keys, check_shards

log = logging.getLogger(__name__)
_REPORTED: set[tuple[str, str, str]] = set()  # (hash, field, value) already logged
_REPORTED_MAX = 1000

Parser = Callable[[str], Any]

# option -> parser of its text form; each raises ValueError/TypeError saying what was wrong
_PARSERS: dict[str, Parser] = {
    "batch_size": lambda v: _check_batch_size(_int(v, "batch_size")),
    "batch_timeout": lambda v: _check_duration("batch_timeout", v, MAX_BATCH_TIMEOUT_S),
    "max_queue": lambda v: _check_max_queue(_int(v, "max_queue")),
    "max_deliveries": lambda v: _check_positive(
        "max_deliveries", _int(v, "max_deliveries"), MAX_DELIVERIES
    ),
    "max_payload_bytes": lambda v: _check_positive(
        "max_payload_bytes", _int(v, "max_payload_bytes"), MAX_PAYLOAD_BYTES
    ),
    "max_reply_bytes": lambda v: _check_reply_bytes(_int(v, "max_reply_bytes")),
    "key_idle_ttl": lambda v: _check_duration("key_idle_ttl", v, MAX_KEY_IDLE_TTL_S),
}
OPTIONS = tuple(_PARSERS)
# Declared options (P:{S}:meta) that clients read besides the run-time ones.
_DECLARED: dict[str, Parser] = {
    **_PARSERS,
    "shards": lambda v: check_shards(_int(v, "shards")),
    "streaming": lambda v: _flag(v, "streaming"),
    "durable": lambda v: _flag(v, "durable"),
}


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r:.60}") from None


def _flag(value: str, name: str) -> bool:
    if value not in ("True", "False"):
        raise ValueError(f"{name} must be True or False, got {value!r:.60}")
    return value == "True"


def parse_assignments(assignments: list[str]) -> dict[str, Any]:
    """``["batch_size=64", "batch_timeout=5ms"]`` -> validated values; errors name the bad one."""
    parsed: dict[str, Any] = {}
    for assignment in assignments:
        name, sep, text = assignment.partition("=")
        if not sep:
            raise ValueError(f"{assignment!r} is not option=value (for example batch_size=64)")
        if name not in _PARSERS:
            raise ValueError(
                f"{name!r} cannot be changed at run time; choose from {', '.join(OPTIONS)}"
            )
        parsed[name] = _PARSERS[name](text)
    return parsed


def parse_overrides(raw: Mapping[str, str], keys: Keys) -> dict[str, Any]:
    """Overrides as stored in ``P:{S}:config``: the valid ones; each field the model refuses
    (unknown, out of bounds, not UTF-8) is logged and left out, and the serving goes on with
    the value it had."""
    return _read(raw, _PARSERS, keys.name, keys.config, unknown=True)


def parse_declared(raw: Mapping[str, str], keys: Keys) -> dict[str, Any]:
    """The options workers declared in ``P:{S}:meta`` that clients act on, validated the same
    way; a refused one is logged and left out (the client then acts as if none was declared)."""
    return _read(raw, _DECLARED, keys.name, keys.meta, unknown=False)


def _read(
    raw: Mapping[str, str], parsers: Mapping[str, Parser], serving: str, where: str,
    *, unknown: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, text in raw.items():
        parse = parsers.get(name)
        if parse is None:
            if unknown:
                _refused(serving, where, name, text, f"{name!r:.60} is not a run-time option")
            continue
        try:
            out[name] = parse(text)
        except (TypeError, ValueError) as e:
            _refused(serving, where, name, text, str(e))
    return out


def _refused(serving: str, where: str, name: str, text: str, why: str) -> None:
    # Once per process and value: a client re-reads a meta hash no worker declared yet on
    # every call, and one bad value must not log a line per call.
    seen = (where, name[:60], text[:80])
    if seen in _REPORTED:
        return
    if len(_REPORTED) >= _REPORTED_MAX:  # many distinct junk values: forget, report again
        _REPORTED.clear()
    _REPORTED.add(seen)
    log.warning(
        "serving %s: ignored %s=%r in %s: %s; remove it (HDEL) or set it with `queueserve "
        "config set`", serving, name[:60], text[:80], where, why,
    )
