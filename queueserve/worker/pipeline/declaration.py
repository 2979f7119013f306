"""A serving's declaration, kept true: the options a worker publishes in ``P:{S}:meta`` (and the
shard count it confirms on the last shard's hash), written again whenever Redis holds something
else (docs/guarantees.md, "Values read from Redis").

Anyone who can write to Redis can write the meta hash, and what is there is acted on:
``enqueue.lua`` admits against its ``max_queue`` and packs up to its ``pack_items`` on every
call, and a client that names a serving takes its codec, limits and shard count from it. The
model (``options/stored.py``) refuses values no worker would declare, but a forged value the model
takes (``max_queue=1``) would stand until a worker restarted. So once a second (the shard-0
reader's config pass, ``reader.CONFIG_EVERY_S``) each partition reads the hash back and writes
the fields that differ from what it declared: one round trip per serving, whatever the number of
batch keys, and a write only when something changed it.

Run-time config (``queueserve config set``) changes what a worker declares: it writes the config
and meta hashes in one transaction, and a worker applies the config before it compares. The
meta hash is read before the config hash, so a ``config set`` landing between the two reads is
seen as a config change, and the comparison waits for the next pass (which applies it first)
instead of writing the old value back.

A field deleted is left deleted (an operator withdraws ``pack_items`` so while workers older
than packs still run: docs/operations.md, "Upgrading workers"); a hash deleted whole, or made
another type, is declared again whole. Workers of one serving that declare different options
(a rolling deploy that changes one) each write their own, every second, until one kind is
gone; each logs it once per value.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from queueserve.broker.consumer import Consumer
from queueserve.serving import Serving
from queueserve.wire.keys import Keys

log = logging.getLogger(__name__)

SAID_MAX = 1000  # (field, value) pairs already logged, kept at most (forged values may vary)


class Declaration:
    """What one partition declared for a serving, and the pass that keeps Redis saying it."""

    def __init__(self, serving: Serving, broker: Consumer, shards: list[Keys]) -> None:
        self.serving = serving  # the runner's copy: run-time config changes what it declares
        self.broker = broker
        self.keys = shards[0]
        # Clients trust a shard count over 1 only when the last shard's hash says it too
        self.last = shards[-1] if len(shards) > 1 else None
        self.confirmed = {"shards": str(len(shards))}
        self._said: set[tuple[str, str, str]] = set()

    def declared(self) -> dict[str, str]:
        """The meta hash's fields as this worker writes them."""
        return {k: str(v) for k, v in self.serving.options().items()}

    def declare(self) -> None:
        """Write the whole declaration (a partition starting)."""
        self.broker.declare(self.keys, self.declared())
        if self.last is not None:
            self.broker.declare(self.last, self.confirmed)

    def keep(self, config_seen: Mapping[str, str]) -> int:
        """Write back the declared fields that Redis holds otherwise; ``config_seen`` is the
        config hash as the worker last applied it (a pass that finds another one writes
        nothing: the next applies it first). Returns how many fields were written."""
        meta, config, last = self.broker.declarations(self.keys, self.last)
        if config is None or config != config_seen:
            return 0
        written = self._write(self.keys, meta, self.declared())
        if self.last is not None:
            written += self._write(self.last, last, self.confirmed)
        return written

    def _write(self, keys: Keys, found: dict[str, str] | None, want: dict[str, str]) -> int:
        """Write the fields of ``want`` that ``found`` (None: a key of another type) lacks or
        holds otherwise."""
        if found is None or not found:
            self._say(keys, "(the key)", "no hash" if found is None else "nothing")
            self.broker.redeclare(keys, want)
            return len(want)
        # A field deleted stays deleted: that is how an operator withdraws one (pack_items,
        # while workers older than packs still run: docs/operations.md, "Upgrading workers")
        wrong = {k: v for k, v in want.items() if k in found and found[k] != v}
        if not wrong:
            return 0
        for name, value in wrong.items():
            self._say(keys, name, found.get(name), value)
        self.broker.declare(keys, wrong)
        return len(wrong)

    def _say(self, keys: Keys, name: str, found: str | None, value: str = "a hash") -> None:
        said = (keys.meta, name, (found or "")[:80])
        if said in self._said:
            return
        if len(self._said) >= SAID_MAX:
            self._said.clear()
        self._said.add(said)
        log.warning(
            "serving %s: %s held %s=%.80r, not what this worker declared (%s): written again "
            "(someone wrote it: a stranger, or a worker of this serving with other options)",
            self.serving.name,
            keys.meta,
            name,
            found,
            value,
        )
