"""What a door asks of Redis through its client, besides sending (the gateway's 404 for an
unknown serving, its readiness, ``GET /v1/models``): a public part of ``AsyncClient``, so the
gateway needs nothing of the client's broker (docs/architecture.md: only broker/ and client/
reach Redis)."""

from __future__ import annotations

from queueserve.broker.async_producer import AsyncProducer
from queueserve.broker.urls import redact_url
from queueserve.wire.keys import Keys


class AsyncRegistry:
    """``client.registry``: the servings declared under the client's prefix, and its Redis."""

    def __init__(self, broker: AsyncProducer, prefix: str) -> None:
        self._broker = broker
        self._prefix = prefix

    @property
    def url(self) -> str:
        """The Redis the client talks to, its password hidden: for logs."""
        return redact_url(self._broker.url)

    async def declared(self, keys: Keys) -> bool:
        """Whether a worker has declared the serving of ``keys`` (its meta hash holds the
        codec, as every declaration does): one HGETALL."""
        return "codec" in await self._broker.meta(keys)

    async def servings(self) -> list[str]:
        """Names of the servings workers list under the prefix, by name: the registry they keep
        (P:servings), read in one bounded round trip whatever Redis holds."""
        return await self._broker.servings(self._prefix)

    async def ping(self) -> None:
        """Return once Redis answers a PING; RedisUnavailable (or another QueueServeError)
        when it does not."""
        await self._broker.ping()
