"""What a client knows of the servings it calls: a ``Target`` per serving (its keys, codec,
batch size, shards and options, from the ``qs.Serving`` object or what its workers declared in
its meta hash), kept by name once a worker has declared it, so a call by name plans without a
round trip. Held by the client's core (core.py); the outbox reads the meta hashes."""

from __future__ import annotations

from queueserve import tracing
from queueserve.client.caching import declared_cache
from queueserve.client.calls import CallTable
from queueserve.client.targets import ShardSpread, Target, claimed_shards, confirmed_shards
from queueserve.client.unserved import unknown_serving_message
from queueserve.errors import BadRequest, UnknownServing
from queueserve.options.stored import declared_rule, parse_declared
from queueserve.serving import Serving
from queueserve.tracing import reads_trace
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys

ServingRef = str | Serving


class TargetTable:
    """The targets of one client, by serving name, and the keys, shard spreads and trace
    gates they share."""

    def __init__(
        self,
        prefix: str,
        shown_url: str,
        trusted_codec: str | None,
        wait_for_worker: bool,
        calls: CallTable,
    ) -> None:
        self._prefix = prefix
        self._shown_url = shown_url
        self._trusted_codec = trusted_codec
        self._wait_for_worker = wait_for_worker
        self._calls = calls  # told each codec a target may answer in
        self._targets: dict[str, Target] = {}
        # Key names per serving name: a serving object's call makes a new Target, whose keys
        # would otherwise be built again (some twenty strings) and kept by the call in flight.
        self._keys: dict[str, Keys] = {}
        self._spreads: dict[str, ShardSpread] = {}
        # Servings whose workers declared they read trace context (tracing.py), by name
        self._traced: dict[str, bool] = {}

    def meta_keys(self, serving: ServingRef) -> Keys | None:
        """Keys whose meta hash to read before ``remember``: None when a serving object (or
        a cached name) says all there is to know."""
        if isinstance(serving, str):
            return self.keys_of(serving)
        if tracing.AVAILABLE and isinstance(serving, Serving) and serving.name not in self._traced:
            return self.keys_of(serving.name)  # read once, for the trace gate
        return None

    def undeclared(self, keys: Keys | None, meta: dict[str, str]) -> bool:
        """Whether a serving named by a string has no meta hash (no worker ever declared it)
        and this client does not wait for workers: the call fails with ``unknown``."""
        return keys is not None and not meta and not self._wait_for_worker

    def unknown(self, name: str, known: list[str]) -> UnknownServing:
        return UnknownServing(unknown_serving_message(name, known, self._prefix, self._shown_url))

    def keys_of(self, name: str) -> Keys:
        keys = self._keys.get(name)
        if keys is None:
            keys = self._keys[name] = Keys(self._prefix, name)
        return keys

    def cached(self, serving: ServingRef) -> Target | None:
        return self._targets.get(serving) if isinstance(serving, str) else None

    def last_shard(self, keys: Keys | None, meta: dict[str, str]) -> Keys | None:
        """When ``meta`` claims more than one shard, the keys of the last one: workers declare
        the count there too, and ``remember`` needs that hash (``confirmation``) to trust it."""
        count = claimed_shards(meta)
        return None if keys is None or count <= 1 else keys.last_shard(count)

    def remember(
        self,
        serving: ServingRef,
        meta: dict[str, str],
        confirmation: dict[str, str] | None = None,
    ) -> Target:
        """The target for ``serving``, given the options its workers declared (maybe none)
        and, for a count of shards over 1, the last shard's meta hash (``last_shard``)."""
        target = self._target_for(serving, meta.get("codec"))
        target.traced = tracing.AVAILABLE and self._reads_trace(target.keys.name, meta)
        if meta:
            target.keeps_jobs = "job_keep" in meta.get(tracing.HEADER_FIELDS, "").split(",")
        if target.serving is not None:
            target.batch_size = target.serving.batch_size
            target.hooks = target.serving.hooks is not None
            target.durable = target.serving.durable
            target.spread = self._spread(target.keys, target.serving.shards)
        elif meta:
            declared = parse_declared(meta, target.keys)
            target.max_payload_bytes = declared.get("max_payload_bytes")
            target.idempotency_ttl = declared.get("idempotency_ttl")
            target.cache_ttl, target.cache_version = declared_cache(declared)
            target.key_rule = declared_rule(meta, target.keys)
            target.batch_size = declared.get("batch_size")
            target.hooks = declared.get("streaming", False)
            target.durable = declared.get("durable", False)
            target.spread = self._spread(
                target.keys,
                confirmed_shards(target.keys, declared.get("shards", 1), confirmation or {}),
            )
        if isinstance(serving, str) and "codec" in meta:
            self._targets[serving] = target
        self._calls.accept(target.codec)
        return target

    def _reads_trace(self, name: str, meta: dict[str, str]) -> bool:
        """Whether serving ``name``'s workers read trace context; learnt once a worker has
        declared the serving (``meta`` holds its codec), from then on without a round trip."""
        known = self._traced.get(name)
        if known is None:
            known = reads_trace(meta)
            if "codec" in meta:
                self._traced[name] = known
        return known

    def _spread(self, keys: Keys, count: int) -> ShardSpread:
        """This client's ShardSpread of a serving (one per shard count it was told)."""
        spread = self._spreads.get(keys.name)
        if spread is None or len(spread.shards) != count:
            spread = self._spreads[keys.name] = ShardSpread(keys, count)
        return spread

    def _target_for(self, serving: ServingRef, meta_codec: str | None) -> Target:
        if isinstance(serving, Serving):
            return Target(
                self.keys_of(serving.name),
                get_codec(serving.codec),
                serving,
                serving.max_queue,
                serving.max_payload_bytes,
            )
        if not isinstance(serving, str):
            raise TypeError(f"serving must be a name or a qs.Serving, got {serving!r}")
        codec = meta_codec or "msgpack"
        if codec != "msgpack" and codec != self._trusted_codec:
            raise BadRequest(
                f"serving {serving!r} is declared with codec {codec!r} in Redis, which a client "
                "does not take on trust when it names a serving: anyone who can write to Redis "
                f"could have set it, and decoding {codec} can run code. Pass the qs.Serving "
                f"object to dispatch, or create the client with codec={codec!r} if you trust "
                "every writer of this Redis"
            )
        return Target(self.keys_of(serving), get_codec(codec), None, 0, None)
