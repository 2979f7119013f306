"""Streamed events (hooks and generator steps), published on the caller's ``P:events:C``: built
by the worker, checked and read by the client (wire/protocol.py, "Event").

An event is ``[request id, seq, *body]``, body one of::

    ["h", hook, payload, start, size]      qs.emit from the batch function
    ["o", RESULTS, values, first, count]   a generator step for items first:first+count
    ["r", run]                             a replay restarts the stream (then each body ends
                                           with run)

The events one step or batch makes for one client travel as one message: the list of them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from queueserve.wire.codec import Codec, loads_tagged
from queueserve.wire.kinds import RESULTS

log = logging.getLogger(__name__)


def hook_event(name: str, payload: Any, start: int, size: int) -> list[Any]:
    return ["h", name, payload, start, size]


def output_event(values: list[Any], first: int) -> list[Any]:
    return ["o", RESULTS, values, first, len(values)]


def restart_event(run: int) -> list[Any]:
    return ["r", run]


def encode_events(
    codec: Codec, events: list[tuple[str, list[Any]]], max_bytes: int
) -> Iterator[tuple[str, bytes]]:
    """(channel, message) for ``events`` ((channel, event) in the order they were made), one
    message per channel: a caller's requests of one step or batch (a client streaming for many
    users has most of a step's sequences) go in one PUBLISH and one decode, a list of events;
    a single event goes alone, as it always did. An event that cannot be sent is dropped with a
    warning (events are not durable: the request's answer still carries its results)."""
    tag = bytes((codec.tag,))
    by_channel: dict[str, list[list[Any]]] = {}
    for channel, event in events:
        if channel in by_channel:
            by_channel[channel].append(event)
        else:
            by_channel[channel] = [event]
    for channel, batch in by_channel.items():
        if len(batch) > 1:
            try:
                data = codec.dumps(batch)
            except Exception:
                data = None
            if data is not None and len(data) < max_bytes:
                yield channel, tag + data
                continue
        for event in batch:  # alone, or the batch failed: each event on its own
            try:
                data = codec.dumps(event)
            except Exception as e:
                log.warning(
                    "dropped a streamed event that codec %r cannot encode: %s", codec.name, e
                )
                continue
            if len(data) >= max_bytes:
                log.warning("dropped a streamed event of %d bytes, over max_reply_bytes", len(data))
                continue
            yield channel, tag + data


def parse_events(message: bytes, accepted: set[int]) -> list[Any]:
    """The events of one message (one event, or a list of them), each still to be checked with
    ``event_problem``; ValueError when the message is not events at all."""
    decoded = loads_tagged(message, accepted, "event")
    if type(decoded) is not list or not decoded:
        raise ValueError(f"an event must be a non-empty list, got {decoded!r:.200}")
    return decoded if type(decoded[0]) is list else [decoded]


def event_problem(event: Any, n: int | None) -> str | None:
    """What is wrong with ``event`` for a request of ``n`` items, if anything (``n`` None: only
    whether it names a request)."""
    if type(event) is not list or not event or type(event[0]) is not int:
        return f"an event must start with a request id, got {event!r:.200}"
    if n is None or (
        len(event) >= 3 and type(event[1]) is int and event[1] >= 0 and _body_ok(event[2:], n)
    ):
        return None
    return f"malformed event for request {event[0]}: {event!r:.200}"


def _body_ok(body: list[Any], n: int) -> bool:
    """``["h", name, payload, start, size]`` or ``["o", kind, values, first, count]``, each
    followed by its run when a replay sent it, or a replay's ``["r", run]``."""
    kind = body[0]
    if kind == "r":
        return len(body) == 2 and _is_run(body[1])
    if len(body) == 6 and _is_run(body[5]):
        body = body[:5]
    if len(body) != 5:
        return False
    if kind == "h":
        return type(body[1]) is str and type(body[3]) is int and type(body[4]) is int
    if kind == "o":
        values, first, count = body[2:]
        return (
            type(values) is list
            and type(first) is int
            and type(count) is int
            and len(values) == count
            and first >= 0
            and first + count <= n
        )
    return False


def _is_run(value: Any) -> bool:
    return type(value) is int and value > 0
