"""The tenants' weights in Redis (``P:tenants``, wire/tenants.py), as a gateway writes them:
at its start and each time its tenants file is reloaded. Workers read them (core.py
``tenant_weights``) with the run-time config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from queueserve.broker.redis_errors import redis_errors
from queueserve.wire.keys import tenants_key
from queueserve.wire.tenants import encode_weights


class AsyncTenants:
    def __init__(self, redis: Any, url: str) -> None:
        self.redis, self.url = redis, url

    async def declare(self, prefix: str, weights: Mapping[str, float]) -> None:
        """Write ``weights`` (every tenant's, 1 included, so a weight set back to 1 is
        seen); a tenant no longer in the file keeps its field: other gateways may serve it."""
        if not weights:
            return
        with redis_errors(self.url):
            await self.redis.hset(tenants_key(prefix), mapping=encode_weights(weights))
