"""The dead-letter stream of a serving: list, replay and drop what could not be served.

A record holds the reason, the delivery count, the stream and entry it came from, and the
entry's own fields (``field:h``, ``field:p``; a pack dead-lettered whole keeps ``field:k``),
so it can be replayed as it was sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from queueserve.broker.common import text
from queueserve.broker.sync import RedisBroker
from queueserve.wire import protocol as P
from queueserve.wire.messages import pack_members


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
    pack: bytes | None  # the 'k' field of a pack dead-lettered whole


class DeadLetters:
    """Dead letters of one serving, over all its shards.

    Each shard keeps its own dead-letter stream (a replay is one script on one slot), so a
    record of shard i > 0 is named ``<entry id>@i``; shard 0's records keep their plain id.
    """

    def __init__(self, broker: RedisBroker, prefix: str, serving: str) -> None:
        self.broker = broker
        self.keys = P.Keys(prefix, serving)
        self.shards = broker.shards(self.keys)

    def records(self, limit: int = 100) -> list[DeadLetter]:
        """The oldest ``limit`` records over every shard, oldest first."""
        found = [r for keys in self.shards for r in self._range(keys, "-", "+", limit)]
        return sorted(found, key=lambda r: _entry_order(r.id))[:limit]

    def get(self, dead_id: str) -> DeadLetter | None:
        keys, entry_id = self._locate(dead_id)
        found = self._range(keys, entry_id, entry_id, 1)
        return found[0] if found else None

    def _locate(self, dead_id: str) -> tuple[P.Keys, str]:
        entry_id, at, shard = dead_id.partition("@")
        if not at:
            return self.keys, dead_id
        if not shard.isdigit() or int(shard) >= len(self.shards):
            raise KeyError(
                f"no dead letter {dead_id}: serving {self.keys.name!r} has shards 0 to "
                f"{len(self.shards) - 1}; use an id as `queueserve dead-letter list` shows it"
            )
        return self.shards[int(shard)], entry_id

    def _range(self, keys: P.Keys, start: str, end: str, limit: int) -> list[DeadLetter]:
        suffix = f"@{keys.shard}" if keys.shard else ""
        return [
            _record(entry_id, fields, suffix)
            for entry_id, fields in self.broker.dead_letters(keys, start, end, limit)
        ]

    def replay(self, dead_id: str) -> list[str]:
        """Send the dead letter's request again (deadline cleared), or each request of a pack
        as an entry of its own; returns the new entry ids."""
        keys, entry_id = self._locate(dead_id)
        record = self.get(dead_id)
        if record is None:
            raise KeyError(f"no dead letter {dead_id} in {keys.dead}")
        try:  # the record is input from whoever can write to Redis: only this shard's streams
            stream_ok = keys.shard_of(record.stream) is keys
        except ValueError:
            stream_ok = False
        if not stream_ok:
            raise ValueError(
                f"dead letter {dead_id} names stream {record.stream!r}, not a request stream "
                f"of {keys.dead}'s shard; it can only be dropped"
            )
        try:
            requests = [_replayable(h, p) for h, p in _requests_of(record)]
        except ValueError as e:
            raise ValueError(
                f"dead letter {dead_id} is not a well-formed request ({record.reason}; {e}); "
                "it can only be dropped"
            ) from None
        new_ids = self.broker.replay_dead_letter(keys, entry_id, record.stream, requests)
        if new_ids is None:
            raise KeyError(f"dead letter {dead_id} was replayed or dropped meanwhile")
        return new_ids

    def drop(self, dead_id: str) -> bool:
        keys, entry_id = self._locate(dead_id)
        return self.broker.drop_dead_letter(keys, entry_id)


def _requests_of(record: DeadLetter) -> list[tuple[bytes, bytes]]:
    """(header, payload) of each request the record holds: its own, or its pack's."""
    if record.header is not None and record.payload is not None:
        return [(record.header, record.payload)]
    if record.pack is not None:
        return [(m[b"h"], m[b"p"]) for m in pack_members({b"k": record.pack})]
    raise ValueError("it has no request header and payload")


def _replayable(raw_header: bytes, payload: bytes) -> tuple[bytes, bytes, int]:
    """(header with its deadline cleared, payload, item count); ValueError if the header is
    not one a worker would read."""
    try:
        header = msgpack.unpackb(raw_header)
    except Exception as e:
        raise ValueError(f"its header is not msgpack: {e}") from None
    count = header[P.H_COUNT] if type(header) is list and len(header) > P.H_DEADLINE else None
    if type(count) is not int or count < 1:
        raise ValueError(f"its header is not a request header: {header!r:.200}")
    header[P.H_DEADLINE] = 0
    return msgpack.packb(header), payload, count


def _entry_order(dead_id: str) -> tuple[int, int]:
    ms, _, seq = dead_id.partition("@")[0].partition("-")
    return int(ms or 0), int(seq or 0)


def _record(entry_id: bytes, fields: dict[bytes, bytes], suffix: str = "") -> DeadLetter:
    def field(name: str) -> str:
        return text(fields.get(name.encode(), b""))

    return DeadLetter(
        id=text(entry_id) + suffix,
        stream=field("stream"),
        entry_id=field("entry_id"),
        reason=field("reason"),
        deliveries=int(field("deliveries") or 0),
        at_ms=int(field("at_ms") or 0),
        header=fields.get(b"field:h"),
        payload=fields.get(b"field:p"),
        pack=fields.get(b"field:k"),
    )
