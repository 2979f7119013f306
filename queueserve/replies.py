"""What the replier writes for a run of rows: events, one message per caller inbox, and acks."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from . import protocol as P
from .codec import Codec
from .execute import Row


@dataclass
class Outgoing:
    """Everything one replier round trip writes, and what it tells the middleware."""

    events: list[tuple[str, bytes]] = field(default_factory=list)  # (channel, message)
    messages: dict[str, list[bytes]] = field(default_factory=dict)  # inbox -> [message]
    acks: dict[str, list[Any]] = field(default_factory=dict)  # stream -> [id, n, id, n...]
    finished: list[tuple[str, bytes]] = field(default_factory=list)  # (stream, id) answered
    answered: int = 0  # items answered (results, errors or dropped)
    errors: dict[str, int] = field(default_factory=dict)  # items by error kind


def compose(rows: list[Row], codec: Codec) -> Outgoing:
    """Group rows per inbox, count down each request's items, and ack those finished.

    Rows are applied in order, so the events of a batch go out before its answers.
    """
    out = Outgoing()
    events: list[tuple[str, list[Any]]] = []
    messages: dict[str, list[list[Any]]] = defaultdict(list)
    acks: dict[str, list[Any]] = defaultdict(list)
    errors: dict[str, int] = defaultdict(int)
    for request, offset, count, kind, body in rows:
        if kind == P.EVENT:
            events.append((request.events, [request.rid, offset, *body]))
            continue
        out.answered += count
        if kind == P.DROP:
            errors["cancelled"] += count
        else:
            if kind == P.ERROR:
                errors[body[3]] += count
            row = [request.rid, offset, count, kind, body]
            if request.events:
                row.append(request.events_sent)
            messages[request.reply_to].append(row)
        request.remaining -= count
        if request.remaining <= 0:
            acks[request.stream] += (request.entry_id, request.admitted)
            out.finished.append(request.ref)
    tag = bytes((codec.tag,))
    out.events = [(channel, tag + codec.dumps(e)) for channel, e in events]
    out.messages = {inbox: [tag + codec.dumps(m)] for inbox, m in messages.items()}
    out.acks, out.errors = dict(acks), dict(errors)
    return out
