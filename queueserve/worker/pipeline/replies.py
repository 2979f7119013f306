"""What the replier writes for a run of rows: events, one message per caller inbox, and acks.

Encoding a result is the last step that can fail because of what the batch function returned
(an object the codec cannot carry, a result over the size Redis accepts), so it is isolated like
the batch function: a message that fails is cut into its rows, a row into its items, and only
the items that cannot be sent are answered with an error. No message exceeds ``max_bytes``
(Redis refuses a bulk string over 512 MiB, and would leave the replier retrying it for ever).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from queueserve.wire import protocol as P
from queueserve.wire.codec import Codec
from queueserve.wire.error import error_body
from queueserve.worker.pipeline.execute import Row

log = logging.getLogger(__name__)


class ReplyQueue:
    """Rows on their way to the replier, and who is sending now.

    Replies leave in the order rows were put: the replier takes everything queued in one go
    and sends it while no one else sends. An executor whose batch found nothing queued and
    nothing being sent may ``claim`` the sender's turn and send its own rows: one thread
    hand-off less per batch, which on an idle worker is most of the worker's share of a round
    trip. ``None`` rows mark an executor's end.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # Rows, a Reply still to be split into rows (worker/pipeline/stages.py), or None.
        self._items: deque[Any] = deque()
        self._sending = False

    def put(self, rows: Any) -> None:
        with self._cond:
            self._items.append(rows)
            self._cond.notify()

    def take(self) -> list[Any]:
        """Everything queued, once there is something and no one is sending; the caller is
        the sender until it calls ``done``."""
        with self._cond:
            while not self._items or self._sending:
                self._cond.wait()
            items = list(self._items)
            self._items.clear()
            self._sending = True
            return items

    def claim(self) -> bool:
        """Become the sender, if nothing is queued and no one is sending (then call ``done``)."""
        with self._cond:
            if self._items or self._sending:
                return False
            self._sending = True
            return True

    def done(self) -> None:
        with self._cond:
            self._sending = False
            if self._items:  # the replier waits only for rows: waking it for none costs a wake
                self._cond.notify()


Message = list[Any]  # one reply row on the wire: [rid, offset, count, kind, body(, events)]


@dataclass
class Composed:
    """Everything one replier round trip writes, and what it tells the middleware."""

    events: list[tuple[str, bytes]] = field(default_factory=list)  # (channel, message)
    messages: dict[str, list[bytes]] = field(default_factory=dict)  # inbox -> [message]
    # stream -> items admitted -> entry ids (ack.lua takes the ids in runs of one count)
    acks: dict[str, dict[int, list[bytes]]] = field(default_factory=dict)
    finished: list[tuple[str, bytes]] = field(default_factory=list)  # (stream, id) answered
    answered: int = 0  # items answered (results, errors or dropped)
    errors: dict[str, int] = field(default_factory=dict)  # items by error kind


def compose(rows: list[Row], codec: Codec, max_bytes: int) -> Composed:
    """Group rows per inbox, count down each request's items, and ack those finished.

    Rows are applied in order, so the events of a batch go out before its answers.
    """
    out = Composed()
    events: list[tuple[str, list[Any]]] = []
    messages: dict[str, list[list[Any]]] = defaultdict(list)
    acks: dict[str, dict[int, list[bytes]]] = defaultdict(dict)
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
                row += request.stream_tail()
            messages[request.reply_to].append(row)
        request.remaining -= count
        if request.remaining <= 0:
            admitted = request.admitted
            if request.pack is not None:  # the entry is done when its last request is
                request.pack.left -= 1
                if request.pack.left > 0:
                    continue
                admitted = request.pack.admitted
            runs = acks[request.stream]
            if admitted in runs:
                runs[admitted].append(request.entry_id)
            else:
                runs[admitted] = [request.entry_id]
            out.finished.append(request.ref)
    tag = bytes((codec.tag,))
    out.events = [(channel, tag + e) for channel, e in _encode_events(codec, events, max_bytes)]
    encoder = _Encoder(codec, tag, max_bytes - 1, errors)
    out.messages = {inbox: encoder.messages(m) for inbox, m in messages.items()}
    out.acks, out.errors = dict(acks), dict(errors)
    return out


def _encode_events(
    codec: Codec, events: list[tuple[str, list[Any]]], max_bytes: int
) -> Iterator[tuple[str, bytes]]:
    """Encoded events, one message per channel: a caller's requests of one step or batch
    (a client streaming for many users has most of a step's sequences) go in one PUBLISH and
    one decode, a list of events, in the order they were made; a single event goes alone, as
    it always did. An event that cannot be sent is dropped with a warning (events are not
    durable: the request's answer still carries its results)."""
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
                yield channel, data
                continue
        for event in batch:  # alone, or the batch failed: each event on its own
            try:
                data = codec.dumps(event)
            except Exception as e:
                log.warning("dropped a streamed event that codec %r cannot encode: %s",
                            codec.name, e)
                continue
            if len(data) >= max_bytes:
                log.warning("dropped a streamed event of %d bytes, over max_reply_bytes",
                            len(data))
                continue
            yield channel, data


class _Encoder:
    """Encodes one inbox's reply rows into messages under the size limit, isolating failures."""

    def __init__(self, codec: Codec, tag: bytes, limit: int, errors: dict[str, int]) -> None:
        self.codec, self.tag, self.limit, self.errors = codec, tag, limit, errors

    def messages(self, rows: list[Message]) -> list[bytes]:
        try:  # the common case: one message, one encode
            data = self.codec.dumps(rows)
        except Exception:
            data = None
        if data is not None and len(data) <= self.limit:
            return [self.tag + data]
        if len(rows) > 1:
            half = len(rows) // 2
            return self.messages(rows[:half]) + self.messages(rows[half:])
        return self._row(rows[0])

    def _row(self, row: Message) -> list[bytes]:
        """One row that did not fit or did not encode: its items one by one."""
        rid, offset, count, kind, body, *events_total = row
        if count == 1:
            return [self.tag + self.codec.dumps([self._item_error(row)])]
        half = count // 2
        first = [rid, offset, half, kind, _cut(kind, body, 0, half), *events_total]
        rest = [rid, offset + half, count - half, kind, _cut(kind, body, half, count),
                *events_total]
        return self.messages([first]) + self.messages([rest])

    def _item_error(self, row: Message) -> Message:
        rid, offset, _count, kind, body, *events_total = row
        try:
            size = len(self.codec.dumps(body))
        except Exception as e:
            problem: Exception = TypeError(
                f"the result of item {offset} cannot be encoded with codec "
                f"{self.codec.name!r}: {e}"
            )
        else:
            problem = ValueError(
                f"the result of item {offset} encodes to {size} bytes, over the serving's "
                f"max_reply_bytes={self.limit + 1}: return smaller results, or raise "
                "max_reply_bytes (Redis refuses values over 512 MiB)"
            )
        if kind == P.ERROR:  # an error too large to send: send it without its traceback
            remote_type, message, _tb, error_kind = body
            return [rid, offset, 1, P.ERROR, [remote_type, message[:10_000], "", error_kind],
                    *events_total]
        self.errors[P.ERR_REMOTE] = self.errors.get(P.ERR_REMOTE, 0) + 1
        log.warning("%s", problem)
        return [rid, offset, 1, P.ERROR, error_body(problem), *events_total]


def _cut(kind: int, body: Any, start: int, end: int) -> Any:
    """Items ``start:end`` of a reply body (a list, or arrays whose first axis is the items)."""
    if kind == P.ERROR:
        return body
    if kind == P.BATCHED and isinstance(body, dict):
        return {name: value[start:end] for name, value in body.items()}
    return body[start:end]
