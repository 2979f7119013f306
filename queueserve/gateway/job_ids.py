"""Job ids handed out over HTTP: unguessable, and each good for the tenant that made it alone.

An HTTP job id is ``<job id>.<tag>``: the client's job id (``<client id>-<number>``, which
anyone can guess) and a tag, the first 16 bytes (128 bits) of HMAC-SHA256 over the tenant's
name and that id, with a key every gateway of the prefix shares (``P:jobkey``: random bytes
in Redis, made by the first gateway that asks; client/async_client.py ``job_id_secret``). A
tag cannot be made without the key, so an id cannot be guessed from another, and another
tenant's id does not check out for the caller: its GET, cancel and DELETE answer 404, as an id
that never existed does, and cost the same (no Redis read before the tag checks out).
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from queueserve.client.async_client import AsyncClient, job_id_secret
from queueserve.gateway.tenants import Tenant

TAG_BYTES = 16
_TAG_CHARS = 26  # base32 of 16 bytes, its padding dropped
MAX_HTTP_ID = 200  # a client's job id is far shorter: a longer one is no id


class JobIds:
    """Makes and checks one gateway's HTTP job ids (the key is read once, on first use)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._key: bytes | None = None

    async def _secret(self) -> bytes:
        if self._key is None:
            self._key = await job_id_secret(self._client)
        return self._key

    async def http_id(self, tenant: Tenant, job_id: str) -> str:
        """The id ``tenant`` follows job ``job_id`` by over HTTP."""
        return f"{job_id}.{_tag(await self._secret(), tenant, job_id)}"

    async def job_id(self, tenant: Tenant, http_id: str) -> str | None:
        """The client's job id that ``http_id`` names for ``tenant``; None when it is not one
        this gateway's key made for that tenant (the caller answers 404)."""
        if len(http_id) > MAX_HTTP_ID:
            return None
        job_id, dot, tag = http_id.rpartition(".")
        if not dot or len(tag) != _TAG_CHARS:
            return None
        expected = _tag(await self._secret(), tenant, job_id)
        return job_id if hmac.compare_digest(tag.encode(), expected.encode()) else None


def _tag(key: bytes, tenant: Tenant, job_id: str) -> str:
    message = f"{tenant.name}\n{job_id}".encode(errors="surrogateescape")
    digest = hmac.new(key, message, hashlib.sha256).digest()[:TAG_BYTES]
    return base64.b32encode(digest).decode().rstrip("=").lower()
