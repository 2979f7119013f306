"""Serving options as stored in Redis: the one model of every value of ``P:{S}:config`` (set
at run time, ``queueserve config set``) and of the options clients act on in ``P:{S}:meta``.

Both hashes are written by whoever can write to Redis, so every value read from them goes
through the rules (and bounds) of ``qs.Serving``, ServingOptions in options/serving_options.py:
``config set`` refuses what a worker would refuse, with the same message, and a worker or
client that reads a value the model refuses logs it and goes on without it
(docs/guarantees.md, "Values read from Redis").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from queueserve.options.serving_options import RUNTIME, ServingOptions, validated
from queueserve.options.units import from_text
from queueserve.wire.key_rules import META_FIELD, LengthBuckets
from queueserve.wire.keys import Keys

log = logging.getLogger(__name__)
_REPORTED: set[tuple[str, str, str]] = set()  # (hash, field, value) already logged
_REPORTED_MAX = 1000

OPTIONS = RUNTIME
# Declared options (P:{S}:meta) that clients read besides the run-time ones.
_DECLARED = (*RUNTIME, "shards", "streaming", "durable", "cache_version")
_FIELDS = ServingOptions.model_fields


def parse_option(name: str, text: str) -> Any:
    """The value of option ``name`` written as ``text``, checked by ServingOptions; a
    ValueError (or TypeError) saying what was wrong."""
    if name == "streaming":  # declared by workers (qs.Serving.streaming()), set by no one
        return from_text(name, bool, text)
    value = from_text(name, _FIELDS[name].annotation, text)
    return getattr(validated(ServingOptions, {name: value}), name)


def parse_assignments(assignments: list[str]) -> dict[str, Any]:
    """``["batch_size=64", "batch_timeout=5ms"]`` -> validated values; errors name the bad one."""
    parsed: dict[str, Any] = {}
    for assignment in assignments:
        name, sep, text = assignment.partition("=")
        if not sep:
            raise ValueError(f"{assignment!r} is not option=value (for example batch_size=64)")
        if name not in RUNTIME:
            raise ValueError(
                f"{name!r} cannot be changed at run time; choose from {', '.join(OPTIONS)}"
            )
        parsed[name] = parse_option(name, text)
    return parsed


def parse_overrides(raw: Mapping[str, str], keys: Keys) -> dict[str, Any]:
    """Overrides as stored in ``P:{S}:config``: the valid ones; each field the model refuses
    (unknown, out of bounds, not UTF-8) is logged and left out, and the serving goes on with
    the value it had."""
    return _read(raw, RUNTIME, keys.name, keys.config, unknown=True)


def parse_declared(raw: Mapping[str, str], keys: Keys) -> dict[str, Any]:
    """The options workers declared in ``P:{S}:meta`` that clients act on, validated the same
    way; a refused one is logged and left out (the client then acts as if none was declared)."""
    return _read(raw, _DECLARED, keys.name, keys.meta, unknown=False)


def declared_rule(raw: Mapping[str, str], keys: Keys) -> LengthBuckets | None:
    """The batch-key rule workers declared in ``P:{S}:meta`` (wire/key_rules.py), or None: none
    declared, or one the rule refuses (logged, and the client sends as if none was)."""
    text = raw.get(META_FIELD)
    if not text:
        return None
    try:
        return LengthBuckets.parse(text)
    except ValueError as e:
        _refused(keys.name, keys.meta, META_FIELD, text, str(e))
        return None


def _read(
    raw: Mapping[str, str],
    options: tuple[str, ...],
    serving: str,
    where: str,
    *,
    unknown: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, text in raw.items():
        if name not in options:
            if unknown:
                _refused(serving, where, name, text, f"{name!r:.60} is not a run-time option")
            continue
        try:
            out[name] = parse_option(name, text)
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
        "config set`",
        serving,
        name[:60],
        text[:80],
        where,
        why,
    )
