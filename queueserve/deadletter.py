"""The dead-letter stream of a serving: list, replay and drop what could not be served.

A record holds the reason, the delivery count, the stream and entry it came from, and the
entry's own fields (``field:h``, ``field:p``), so it can be replayed as it was sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import msgpack

from . import protocol as P
from .broker import RedisBroker, load_script, redis_errors, text


@dataclass(frozen=True)
class DeadLetter:
    id: str
    stream: str
    entry_id: str
    reason: str
    deliveries: int
    at_ms: int
    header: bytes | None
    payload: bytes | None


class DeadLetters:
    """Dead letters of one serving."""

    def __init__(self, broker: RedisBroker, prefix: str, serving: str) -> None:
        self.broker = broker
        self.keys = P.Keys(prefix, serving)
        self._replay = broker.redis.register_script(load_script("replay.lua"))

    def records(self, limit: int = 100) -> list[DeadLetter]:
        return self._range("-", "+", limit)

    def get(self, dead_id: str) -> DeadLetter | None:
        found = self._range(dead_id, dead_id, 1)
        return found[0] if found else None

    def _range(self, start: str, end: str, limit: int) -> list[DeadLetter]:
        with redis_errors(self.broker.url):
            raw = self.broker.redis.xrange(self.keys.dead, start, end, count=limit)
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], raw or [])
        return [_record(entry_id, fields) for entry_id, fields in entries]

    def replay(self, dead_id: str) -> str:
        """Send the dead letter's request again (deadline cleared); returns the new entry id."""
        record = self.get(dead_id)
        if record is None:
            raise KeyError(f"no dead letter {dead_id} in {self.keys.dead}")
        if record.header is None or record.payload is None:
            raise ValueError(
                f"dead letter {dead_id} is not a well-formed request ({record.reason}); it can "
                "only be dropped"
            )
        header = msgpack.unpackb(record.header)
        header[P.H_DEADLINE] = 0
        with redis_errors(self.broker.url):
            new_id = self._replay(
                keys=[self.keys.dead, record.stream, self.keys.queued],
                args=[dead_id, msgpack.packb(header), record.payload, header[P.H_COUNT]],
            )
        if not new_id:
            raise KeyError(f"dead letter {dead_id} was replayed or dropped meanwhile")
        return text(new_id)

    def drop(self, dead_id: str) -> bool:
        with redis_errors(self.broker.url):
            return bool(self.broker.redis.xdel(self.keys.dead, dead_id))


def _record(entry_id: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
    def field(name: str) -> str:
        return text(fields.get(name.encode(), b""))

    return DeadLetter(
        id=text(entry_id),
        stream=field("stream"),
        entry_id=field("entry_id"),
        reason=field("reason"),
        deliveries=int(field("deliveries") or 0),
        at_ms=int(field("at_ms") or 0),
        header=fields.get(b"field:h"),
        payload=fields.get(b"field:p"),
    )
