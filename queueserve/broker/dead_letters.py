"""Dead letters: entries nobody can run, copied to their shard's dead-letter stream with why
(``DeadLetter``), by the worker's ``Consumer`` (its part ``consumer.letters``); and the
operators' shelf of them (``DeadLetterShelf``: counted, listed, replayed, dropped), a part of
``Admin`` (``admin.shelf``)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, cast

from queueserve.broker.common import StreamEntries, ack_arguments, text
from queueserve.broker.core import BrokerCore
from queueserve.broker.redis_errors import redis_errors
from queueserve.wire.keys import GROUP, Keys
from queueserve.wire.priority import PRIORITY_AGE_MS


class DeadLetter(NamedTuple):
    """An entry to copy to its shard's dead-letter stream, with why (each of ``records``: one
    for an entry, one per request of a pack that fails). ``ack_now`` acks and deletes the
    entry too, for entries nobody can be answered for; otherwise the replier acks it after
    telling the caller. ``released``: the items enqueue.lua admitted it with, given back to
    the admission counters when it is acked now (ack.lua), so an entry nobody can answer does
    not hold ``max_queue`` room for ever."""

    stream: str
    entry_id: bytes
    records: Sequence[Mapping[str, Any]]
    ack_now: bool
    released: int = 0


class DeadLetterWriter:
    """Writing dead letters, over the consumer's connection."""

    def __init__(self, core: BrokerCore) -> None:
        self.url, self.redis, self._ack = core.url, core.redis, core._ack

    def dead_letter(
        self,
        keys: Keys,
        stream: str,
        entry_id: bytes,
        *records: Mapping[str, Any],
        ack_now: bool,
    ) -> None:
        """Dead-letter one entry (see DeadLetter)."""
        self.write_dead_letters(keys, [DeadLetter(stream, entry_id, records, ack_now)])

    def write_dead_letters(self, keys: Keys, letters: Sequence[DeadLetter]) -> None:
        """Copy entries to the dead-letter streams of their shards, one transaction per shard
        however many entries there are (a read's worth of forged entries costs the reader one).

        Per shard one transaction (MULTI/EXEC) holds the records and the acks of the entries
        acked now: a Redis error before EXEC writes neither, so the worker that serves such an
        entry again writes its record once, never a second copy beside the first. The other
        entries' acks follow their callers' answers (the replier's)."""
        at_ms = int(time.time() * 1000)
        by_shard: dict[str, list[DeadLetter]] = {}
        for letter in letters:
            by_shard.setdefault(keys.shard_of(letter.stream).dead, []).append(letter)
        with redis_errors(self.url):
            for dead, group in by_shard.items():
                pipe = self.redis.pipeline(transaction=True)
                for stream, entry_id, records, _, _ in group:
                    for record in records:
                        fields: dict[Any, Any] = {
                            "stream": stream,
                            "entry_id": entry_id,
                            "at_ms": at_ms,
                            **record,
                        }
                        pipe.xadd(dead, fields)
                self._ack_in(pipe, keys, [letter for letter in group if letter.ack_now])
                pipe.execute()

    def _ack_in(self, pipe: Any, keys: Keys, letters: Sequence[DeadLetter]) -> None:
        """Ack ``letters`` in the transaction ``pipe``: through ack.lua, which gives their
        admitted items back, for those that hold some (EVAL, not EVALSHA: a script missing
        from Redis fails inside the transaction, after its records were written), else a
        bare XACK and XDEL."""
        for stream, entry_id, _, _, released in letters:
            if released:
                script_keys, args = ack_arguments(
                    keys.shard_of(stream), stream, {released: [entry_id]}
                )
                pipe.execute_command(
                    "EVAL", self._ack.script, len(script_keys), *script_keys, *args
                )
            else:
                pipe.xack(stream, GROUP, entry_id)
                pipe.xdel(stream, entry_id)


class DeadLetterShelf:
    """The operators' dead letters (ops/deadletter.py, the dashboard's counts), over the
    admin's connection."""

    def __init__(self, core: BrokerCore) -> None:
        self.url, self.redis, self._replay = core.url, core.redis, core._replay

    def dead_letter_depths(self, keys_list: Sequence[Keys]) -> list[tuple[Keys, int]]:
        with redis_errors(self.url):
            pipe = self.redis.pipeline(transaction=False)
            for keys in keys_list:
                pipe.xlen(keys.dead)
            return list(zip(keys_list, (int(n) for n in pipe.execute()), strict=True))

    def dead_letters(
        self, keys: Keys, start: str, end: str, limit: int
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Records of the serving's dead-letter stream from ``start`` to ``end`` (ids)."""
        with redis_errors(self.url):
            raw = self.redis.xrange(keys.dead, start, end, count=limit)
        return cast(list[tuple[bytes, dict[bytes, bytes]]], raw or [])

    def newest_dead_letter(self, keys: Keys) -> str | None:
        """The id of the serving shard's newest dead letter, None when it has none."""
        with redis_errors(self.url):
            raw = cast(StreamEntries, self.redis.xrevrange(keys.dead, "+", "-", count=1))
        return text(raw[0][0]) if raw else None

    def replay_dead_letter(
        self, keys: Keys, dead_id: str, stream: str, requests: Sequence[tuple[bytes, bytes, int]]
    ) -> list[str] | None:
        """Queue a dead letter's requests (header, payload, items) again, one entry each, and
        drop the record, atomically (replay.lua); returns the new entry ids, or None when the
        record is gone (replayed or dropped meanwhile) or names another stream by now.

        ``stream`` must be a request stream of ``keys``' shard, and each item count an int
        from 1 to its payload's length: the caller checked both (ops/deadletter.py)."""
        batch_key, priority = keys.parse_stream(stream)
        args: list[Any] = [dead_id, GROUP, batch_key, priority, PRIORITY_AGE_MS]
        for header, payload, n in requests:
            args += [header, payload, n]
        script_keys = [
            *(keys.dead, stream, keys.queued, keys.seen, keys.ready, keys.wake, keys.depth),
            keys.pdepth,
        ]
        with redis_errors(self.url):
            new_ids = self._replay(keys=script_keys, args=args)
        return [text(i) for i in new_ids] if new_ids else None

    def drop_dead_letter(self, keys: Keys, dead_id: str) -> bool:
        with redis_errors(self.url):
            return bool(self.redis.xdel(keys.dead, dead_id))
