"""Replies: one message per (client, batch) in the caller's inbox, built by the worker's
replier and read by the client (wire/protocol.py, "Reply").

A message is a codec tag byte and the codec's encoding of its rows,
``[[request id, offset, count, kind, body(, events_total(, run))], ...]``. Encoding a result
is the last step that can fail because of what the batch function returned (an object the
codec cannot carry, a result over the size Redis accepts), so it is isolated like the batch
function. No message exceeds the serving's max_reply_bytes (Redis refuses a bulk string over
512 MiB, and would leave the replier retrying it for ever).
"""

from __future__ import annotations

import logging
from typing import Any

from queueserve.wire.codec import Codec, loads_tagged
from queueserve.wire.error import error_body
from queueserve.wire.kinds import BATCHED, ERR_REMOTE, ERROR

log = logging.getLogger(__name__)

Message = list[Any]  # one reply row on the wire: [rid, offset, count, kind, body(, events)]


def parse_reply(message: bytes, accepted: set[int]) -> list[Any]:
    """The rows of one reply message, each ``[rid, offset, count, kind, body, *tail]`` (tail:
    events_total and run, for streamed requests)."""
    rows: list[Any] = loads_tagged(message, accepted, "reply")
    return rows


class ReplyEncoder:
    """Encodes one inbox's reply rows into messages of at most ``limit`` + 1 bytes (with the
    codec tag), isolating failures: a message that fails is cut into its rows, a row into its
    items, and only the items that cannot be sent are answered with an error. ``errors``
    counts those (by error kind) for the middleware."""

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
        rest = [
            rid,
            offset + half,
            count - half,
            kind,
            _cut(kind, body, half, count),
            *events_total,
        ]
        return self.messages([first]) + self.messages([rest])

    def _item_error(self, row: Message) -> Message:
        rid, offset, _count, kind, body, *events_total = row
        try:
            size = len(self.codec.dumps(body))
        except Exception as e:
            problem: Exception = TypeError(
                f"the result of item {offset} cannot be encoded with codec {self.codec.name!r}: {e}"
            )
        else:
            problem = ValueError(
                f"the result of item {offset} encodes to {size} bytes, over the serving's "
                f"max_reply_bytes={self.limit + 1}: return smaller results, or raise "
                "max_reply_bytes (Redis refuses values over 512 MiB)"
            )
        if kind == ERROR:  # an error too large to send: send it without its traceback
            remote_type, message, _tb, error_kind = body
            return [
                rid,
                offset,
                1,
                ERROR,
                [remote_type, message[:10_000], "", error_kind],
                *events_total,
            ]
        self.errors[ERR_REMOTE] = self.errors.get(ERR_REMOTE, 0) + 1
        log.warning("%s", problem)
        return [rid, offset, 1, ERROR, error_body(problem), *events_total]


def _cut(kind: int, body: Any, start: int, end: int) -> Any:
    """Items ``start:end`` of a reply body (a list, or arrays whose first axis is the items)."""
    if kind == ERROR:
        return body
    if kind == BATCHED and isinstance(body, dict):
        return {name: value[start:end] for name, value in body.items()}
    return body[start:end]
