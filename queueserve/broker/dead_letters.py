"""Dead letters: entries nobody can run, copied to their shard's dead-letter stream with why
(``DeadLetter``), by the worker's ``Consumer`` (its part ``consumer.letters``)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from queueserve.broker.common import ack_arguments
from queueserve.broker.core import BrokerCore
from queueserve.broker.redis_errors import redis_errors
from queueserve.wire.keys import GROUP, Keys


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


class DeadLetters:
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
