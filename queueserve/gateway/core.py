"""What every route shares: the one ``AsyncClient`` of the process, which servings exist,
whether Redis answers (``ready``), and a call that is withdrawn when its HTTP client
disconnects."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Mapping
from typing import Any, cast

from starlette.types import Receive

from queueserve.client.async_client import AsyncClient, AsyncTicket, declare_tenants
from queueserve.door.http_errors import ApiError, bad_request, from_queueserve
from queueserve.errors import QueueServeError
from queueserve.gateway.job_ids import JobIds
from queueserve.gateway.quotas import Quotas
from queueserve.gateway.tenants import ANONYMOUS, DEFAULT, Tenant, Tenants
from queueserve.gateway.watch import Watches
from queueserve.hooks import Event
from queueserve.wire.keys import Keys

log = logging.getLogger(__name__)

MAX_NAME = 200  # longer serving names are not looked up in Redis
# How long /readyz waits for Redis's PING: well under a load balancer's probe timeout, so an
# unreachable Redis (no answer at all) is a 503, not a probe that times out.
READY_TIMEOUT_S = 2.0
CHECK_MODELS_TIMEOUT_S = 5.0  # the startup check of --model mappings, Redis down included
DECLARE_TIMEOUT_S = 5.0  # writing the tenants' weights, at start and on SIGHUP


class Gateway:
    """The state of one app: its client (made on first use when given a URL, so a mounted
    app, whose lifespan never runs, works too), and the servings known to exist."""

    def __init__(
        self,
        client_or_url: AsyncClient | str | None,
        prefix: str | None,
        max_body_bytes: int,
        models: dict[str, str],
    ) -> None:
        self._client = client_or_url if isinstance(client_or_url, AsyncClient) else None
        self._url = None if isinstance(client_or_url, AsyncClient) else client_or_url
        self._prefix = prefix
        self.owns_client = self._client is None
        self.max_body_bytes = max_body_bytes
        self.models = models
        self._known: set[str] = set()
        self._watches = Watches()
        self.quotas = Quotas()
        self._tasks: set[asyncio.Task[None]] = set()
        self._job_ids: JobIds | None = None
        self._ready: bool | None = None  # what the last /readyz found (None: not asked yet)

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient(self._url, prefix=self._prefix)
        return self._client

    @property
    def job_ids(self) -> JobIds:
        if self._job_ids is None:
            self._job_ids = JobIds(self.client)
        return self._job_ids

    @property
    def prefix(self) -> str:
        # The client's own: a client handed in may use any prefix.
        return self.client.prefix

    async def aclose(self) -> None:
        self._watches.close()
        if self.owns_client and self._client is not None:
            await self._client.aclose()

    @property
    def redis(self) -> str:
        """The client's Redis URL, its password hidden: for logs."""
        return self.client.registry.url

    async def require(self, name: str, model: str | None = None) -> None:
        """404 unless a worker declared serving ``name`` (its meta hash holds the codec, as
        every declaration does), naming the ``model`` the caller asked for when it is not the
        serving's own name. A known name costs nothing; an unknown one an HGETALL."""
        if name in self._known:
            return
        if await self._declared(name):
            self._known.add(name)
            return
        shown = f"{name[:MAX_NAME]!r}"
        if model is None:
            what = f"serving {shown}"
        elif model == name:
            what = f"model {shown} (taken as a serving's name: no --model maps it)"
        else:
            what = f"serving {shown}, which model {model[:MAX_NAME]!r} maps to (--model),"
        raise ApiError(
            404,
            "unknown_serving",
            f"no worker has declared {what} under prefix {self.prefix!r}; GET /v1/models "
            "lists the servings there are",
        )

    async def _declared(self, name: str) -> bool:
        try:
            keys = Keys(self.prefix, name) if len(name) <= MAX_NAME else None
        except ValueError:
            return False
        if keys is None:
            return False
        try:
            return await self.client.registry.declared(keys)
        except QueueServeError as e:
            raise from_queueserve(e) from None

    async def declare_tenants(self, tenants: Tenants) -> None:
        """Write the tenants' weights where the workers read them (wire/tenants.py); Redis
        away or slow: logged, and the workers share service by the weights they had."""
        if tenants.path is None:  # one tenant or none: nothing to share
            return
        weights = tenants.weights()
        try:
            await asyncio.wait_for(declare_tenants(self.client, weights), DECLARE_TIMEOUT_S)
        except (QueueServeError, TimeoutError) as e:
            log.warning(
                "gateway: the tenants' weights were not written to Redis (workers share "
                "service by the ones they had): %s",
                self._no_answer(e, DECLARE_TIMEOUT_S),
            )

    def keep(self, task: asyncio.Task[None]) -> None:
        """Hold a task of the app's own until it ends (the loop keeps only weak references)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def ready(self) -> bool:
        """Whether Redis answers a PING within READY_TIMEOUT_S; a change from the last
        answer is logged (once per outage, not once per probe)."""
        try:
            await asyncio.wait_for(self.client.registry.ping(), READY_TIMEOUT_S)
        except (QueueServeError, TimeoutError) as e:
            if self._ready is not False:
                log.warning(
                    "gateway: not ready: %s; /readyz answers 503 until Redis answers",
                    self._no_answer(e, READY_TIMEOUT_S),
                )
            self._ready = False
            return False
        if self._ready is False:
            log.info("gateway: ready again: Redis at %s answers", self.redis)
        self._ready = True
        return True

    async def check_models(self, models: Mapping[str, str]) -> None:
        """Log a warning for each of ``models`` (model -> serving) whose serving no worker
        has declared (yet): its requests would get 404. Redis away: said, and left to the
        requests."""
        try:
            await asyncio.wait_for(self._warn_undeclared(models), CHECK_MODELS_TIMEOUT_S)
        except (ApiError, TimeoutError) as e:
            log.warning(
                "gateway: could not check the --model mappings: %s",
                self._no_answer(e, CHECK_MODELS_TIMEOUT_S),
            )

    def _no_answer(self, error: Exception, waited: float) -> str:
        """What a failed read of Redis says (its error names the Redis), or that it did not
        answer within ``waited`` seconds."""
        if isinstance(error, TimeoutError):
            return f"Redis at {self.redis} did not answer within {waited:g} s"
        return str(error)

    async def _warn_undeclared(self, models: Mapping[str, str]) -> None:
        undeclared = [(m, s) for m, s in models.items() if not await self._declared(s)]
        if not undeclared:
            return
        try:
            names = await self.servings()
        except QueueServeError as e:
            raise from_queueserve(e) from None
        there = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        for model, serving in undeclared:
            log.warning(
                "gateway: --model %s=%s: no worker has declared serving %r under prefix %r on "
                "%s (servings declared there: %s); requests for model %r get 404 until one "
                "does: check the serving's name, or start its worker",
                model,
                serving,
                serving,
                self.prefix,
                self.redis,
                there or "none",
                model,
            )

    async def servings(self) -> list[str]:
        """Names of the servings workers list under this prefix, by name: the registry they
        keep (P:servings), read in one bounded round trip whatever Redis holds, never a SCAN
        of the keyspace (docs/operations.md, "The servings registry")."""
        return await self.client.registry.servings()

    async def stream(
        self,
        tenant: Tenant,
        serving: str,
        items: list[Any],
        priority: int = 0,
        *,
        model: str | None = None,
        **options: Any,
    ) -> AsyncGenerator[Event, None]:
        """``AsyncClient.stream`` as ``tenant``: the serving required (``require``, naming
        ``model``) and its limits checked now, before an answer starts, and the limits again
        as the stream starts; closing it withdraws its requests."""
        await self.require(serving, model)
        self.quotas.admit(tenant, len(items), priority)
        return self._stream(tenant, serving, items, priority, **options)

    async def _stream(
        self, tenant: Tenant, serving: str, items: list[Any], priority: int, **options: Any
    ) -> AsyncGenerator[Event, None]:
        self.quotas.admit(tenant, len(items), priority)
        hold = self.quotas.hold(tenant, len(items)) if tenant.max_queued is not None else None
        events = self.client.stream(
            serving, items, priority=priority, tenant=_header_name(tenant), **options
        )
        try:
            async for event in events:
                yield event
        finally:
            await cast(AsyncGenerator[Event, None], events).aclose()
            if hold is not None:
                hold.release()

    async def submit(
        self,
        tenant: Tenant,
        serving: str,
        items: list[Any],
        options: Any,
        keep: float | None = None,
        idempotency_key: str | None = None,
        model: str | None = None,
    ) -> AsyncTicket:
        """``AsyncClient.submit`` as ``tenant`` with the request's options, its errors as HTTP
        ones: 404 for a serving no worker declared (``require``, naming ``model``), 403 past
        the tenant's max_priority, 429 past its max_queued; with an ``Idempotency-Key``
        header's key, the first request of that key and tenant."""
        await self.require(serving, model)
        self.quotas.admit(tenant, len(items), options.priority)
        try:
            ticket = await self.client.submit(
                serving,
                items,
                batch_key=options.batch_key,
                timeout=options.timeout,
                priority=options.priority,
                keep=keep,
                tenant=_header_name(tenant),
                idempotency_key=idempotency_key,
            )
        except QueueServeError as e:
            raise from_queueserve(e) from None
        except (TypeError, ValueError, OverflowError) as e:  # an item the codec cannot carry
            raise bad_request(str(e)) from None
        if tenant.max_queued is not None:
            ticket.when_done(self.quotas.hold(tenant, len(items), ticket).release)
        return ticket

    async def call(
        self,
        receive: Receive,
        tenant: Tenant,
        serving: str,
        items: list[Any],
        options: Any,
        return_exceptions: bool = False,
        idempotency_key: str | None = None,
        model: str | None = None,
    ) -> list[Any]:
        """``items``' results (``submit``), the request withdrawn if the HTTP client
        disconnects first; unless it has an idempotency key: its client's retry is owed its
        answer."""
        ticket = await self.submit(tenant, serving, items, options, None, idempotency_key, model)
        watch = None if idempotency_key else self._watches.watch(receive, ticket)
        try:
            return await ticket.result(return_exceptions=return_exceptions)
        except QueueServeError as e:
            raise from_queueserve(e) from None
        finally:
            if watch is not None:
                watch.end()


def _header_name(tenant: Tenant) -> str | None:
    """The tenant a request names (its header, its lane: wire/tenants.py): a tenants file's;
    none for the one caller of a --token or open gateway (nothing to tell apart: its requests
    travel as a Python client's, with no bytes added)."""
    return None if tenant is ANONYMOUS or tenant is DEFAULT else tenant.name
