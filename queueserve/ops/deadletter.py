"""The dead-letter stream of a serving: list, replay and drop what could not be served.

A record holds the reason, the delivery count, the stream and entry it came from, and the
entry's own fields (``field:h``, ``field:p``; a pack dead-lettered whole keeps ``field:k``),
so it can be replayed as it was sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from queueserve.broker.admin import Admin
from queueserve.wire.codec import MsgpackCodec
from queueserve.wire.keys import Keys, is_events_channel, is_inbox
from queueserve.wire.protocol import H_CODEC, H_COUNT, H_REPLY_TO, MAX_PACK_REQUESTS
from queueserve.wire.request import (
    check_msgpack_items,
    header_events,
    header_priority,
    pack_members,
    parse_header,
    without_deadline,
)


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

    def __init__(self, broker: Admin, prefix: str, serving: str) -> None:
        self.broker = broker
        self.keys = Keys(prefix, serving)
        self.shards = broker.shards(self.keys)

    def records(self, limit: int = 100) -> list[DeadLetter]:
        """The oldest ``limit`` records over every shard, oldest first."""
        found = [r for keys in self.shards for r in self._range(keys, "-", "+", limit)]
        return sorted(found, key=lambda r: _entry_order(r.id))[:limit]

    def get(self, dead_id: str) -> DeadLetter | None:
        keys, entry_id = self._locate(dead_id)
        found = self._range(keys, entry_id, entry_id, 1)
        return found[0] if found else None

    def _locate(self, dead_id: str) -> tuple[Keys, str]:
        entry_id, at, shard = dead_id.partition("@")
        if not at:
            return self.keys, dead_id
        if not shard.isdigit() or int(shard) >= len(self.shards):
            raise KeyError(
                f"no dead letter {dead_id}: serving {self.keys.name!r} has shards 0 to "
                f"{len(self.shards) - 1}; use an id as `queueserve dead-letter list` shows it"
            )
        return self.shards[int(shard)], entry_id

    def _range(self, keys: Keys, start: str, end: str, limit: int) -> list[DeadLetter]:
        suffix = f"@{keys.shard}" if keys.shard else ""
        return [
            _record(entry_id, fields, suffix)
            for entry_id, fields in self.broker.dead_letters(keys, start, end, limit)
        ]

    def each(self, page: int = 100) -> Iterator[DeadLetter]:
        """Every record there when the pass reaches its shard, shard by shard, oldest first,
        read ``page`` at a time (a million records are never held at once). Records written
        meanwhile are left out: a replayed request that is dead-lettered again is not
        replayed again by the same pass."""
        for keys in self.shards:
            start, end = "-", self.broker.newest_dead_letter(keys)
            while end is not None and (found := self._range(keys, start, end, page)):
                yield from found
                start = "(" + found[-1].id.partition("@")[0]

    def replay(self, dead_id: str) -> list[str]:
        """Send the dead letter's request again (deadline cleared), or each request of a pack
        as an entry of its own; returns the new entry ids.

        The record is input from whoever can write to Redis, so every field is checked before
        anything is written: ValueError saying what is wrong (the record is kept, to be
        dropped), KeyError when there is no such record."""
        keys, entry_id = self._locate(dead_id)
        record = self.get(dead_id)
        if record is None:
            raise KeyError(f"no dead letter {dead_id} in {keys.dead}")
        try:
            requests = _checked(keys, record)
        except ValueError as e:
            raise ValueError(
                f"dead letter {dead_id} cannot be replayed ({record.reason:.200}): {e}; "
                f"it is kept, and can only be dropped (`queueserve dead-letter drop {keys.name} "
                f"{dead_id}`)"
            ) from None
        new_ids = self.broker.replay_dead_letter(keys, entry_id, record.stream, requests)
        if new_ids is None:
            raise KeyError(f"dead letter {dead_id} was replayed or dropped meanwhile")
        return new_ids

    def replay_each(self, ids: Iterable[str]) -> Iterator[tuple[str, list[str] | Exception]]:
        """(dead-letter id, new entry ids) for each record replayed, or (id, the KeyError or
        ValueError) for each refused: a junk record is reported and kept, and the rest are
        replayed."""
        for dead_id in ids:
            try:
                yield dead_id, self.replay(dead_id)
            except (KeyError, ValueError) as e:
                yield dead_id, e

    def drop(self, dead_id: str) -> bool:
        keys, entry_id = self._locate(dead_id)
        return self.broker.drop_dead_letter(keys, entry_id)


def _checked(keys: Keys, record: DeadLetter) -> list[tuple[bytes, bytes, int]]:
    """(header with its deadline cleared, payload, item count) of each request the record
    holds, once each is a request this shard's workers would run and answer; else ValueError.

    What replay writes, the workers must release: the admission counter rises by each
    request's count, and only the ack of an answerable request (a valid header, an inbox of
    this prefix) gives it back; a request nobody can be told of is dead-lettered again
    without release. So every field is checked here, not left to the worker."""
    try:
        valid = keys.shard_of(record.stream) is keys
        _, priority = keys.parse_stream(record.stream)
    except ValueError:
        valid = False
    if not valid:
        raise ValueError(
            f"it names {record.stream!r:.200}, which is not a request stream of {keys.dead}'s "
            f"shard ({keys.stream('<batch key>')} or {keys.stream('<batch key>', 1)}...)"
        )
    return [_replayable(keys, priority, h, p) for h, p in _requests_of(record)]


def _requests_of(record: DeadLetter) -> list[tuple[bytes, bytes | None]]:
    """(header, payload) of each request the record holds: its own, or its pack's."""
    if record.header is not None:
        return [(record.header, record.payload)]
    if record.pack is None:
        raise ValueError("it has no request header ('field:h') and no pack ('field:k')")
    members = pack_members({b"k": record.pack})
    if len(members) > MAX_PACK_REQUESTS:
        raise ValueError(
            f"its pack holds {len(members)} requests, more than any pack enqueue.lua writes "
            f"({MAX_PACK_REQUESTS})"
        )
    return [(m[b"h"], m[b"p"]) for m in members]


def _replayable(
    keys: Keys, priority: int, raw_header: bytes, payload: bytes | None
) -> tuple[bytes, bytes, int]:
    """One request as replay.lua takes it; ValueError saying which field a worker would
    refuse, or which disagrees with the rest of the record."""
    header = parse_header(raw_header)
    count, reply_to, codec = header[H_COUNT], header[H_REPLY_TO], header[H_CODEC]
    events = header_events(header)
    if not is_inbox(keys.prefix, reply_to):
        raise ValueError(
            f"its reply address {reply_to!r:.100} is not an inbox of prefix "
            f"{keys.prefix!r} ({keys.prefix}:inbox:<client id>)"
        )
    if events and not is_events_channel(keys.prefix, events):
        raise ValueError(
            f"its events channel {events!r:.100} is not a client channel of "
            f"prefix {keys.prefix!r} ({keys.prefix}:events:<client id>)"
        )
    own = header_priority(header)
    if own != priority:
        raise ValueError(f"its header says priority {own}, its stream priority {priority}")
    if type(codec) is not str:
        raise ValueError(f"its codec name must be a string, got {codec!r:.100}")
    if payload is None:
        raise ValueError("it has no payload ('field:p')")
    if count > len(payload):
        raise ValueError(
            f"its header claims {count} items, more than its payload of "
            f"{len(payload)} bytes can hold"
        )
    if codec == MsgpackCodec.name:
        check_msgpack_items(payload, count)
    return without_deadline(header), payload, count


def _entry_order(dead_id: str) -> tuple[int, int]:
    ms, _, seq = dead_id.partition("@")[0].partition("-")
    return int(ms or 0), int(seq or 0)


def _record(entry_id: bytes, fields: dict[bytes, bytes], suffix: str = "") -> DeadLetter:
    """A record as written, whatever it holds: fields are shown, never trusted (replay checks
    them), so a forged one is listed and can be dropped."""

    def field(name: str) -> str:
        return fields.get(name.encode(), b"").decode(errors="replace")

    def number(name: str) -> int:
        value = field(name)
        return int(value) if value.isascii() and value.isdigit() and len(value) <= 18 else 0

    return DeadLetter(
        id=entry_id.decode() + suffix,
        stream=field("stream"),
        entry_id=field("entry_id"),
        reason=field("reason"),
        deliveries=number("deliveries"),
        at_ms=number("at_ms"),
        header=fields.get(b"field:h"),
        payload=fields.get(b"field:p"),
        pack=fields.get(b"field:k"),
    )
