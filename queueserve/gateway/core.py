"""What every route shares: the one ``AsyncClient`` of the process, which servings exist, and
a call that is withdrawn when its HTTP client disconnects."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable
from typing import Any, cast

from starlette.types import Receive

from queueserve.broker.errors import redis_errors
from queueserve.client.aio import AsyncClient, AsyncTicket
from queueserve.errors import QueueServeError
from queueserve.gateway.errors import ApiError, bad_request, from_queueserve
from queueserve.gateway.watch import Watches
from queueserve.hooks import Event
from queueserve.wire.protocol import Keys

MAX_NAME = 200  # longer serving names are not looked up in Redis


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

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient(self._url, prefix=self._prefix)
        return self._client

    @property
    def prefix(self) -> str:
        # The client's own: a client handed in may use any prefix.
        return self.client.prefix

    async def aclose(self) -> None:
        self._watches.close()
        if self.owns_client and self._client is not None:
            await self._client.aclose()

    async def require(self, name: str, what: str = "serving") -> None:
        """404 unless a worker declared ``name`` (its meta hash holds the codec, as every
        declaration does). A known name costs nothing; an unknown one an HGETALL."""
        if name in self._known:
            return
        try:
            keys = Keys(self.prefix, name) if len(name) <= MAX_NAME else None
        except ValueError:
            keys = None
        if keys is not None:
            try:
                declared = "codec" in await self.client._broker.meta(keys)
            except QueueServeError as e:
                raise from_queueserve(e) from None
            if declared:
                self._known.add(name)
                return
        raise ApiError(
            404,
            "unknown_serving",
            f"no worker has declared {what} {name[:MAX_NAME]!r} under prefix "
            f"{self.prefix!r}; GET /v1/models lists the servings there are",
        )

    async def servings(self) -> list[str]:
        """Names of the servings workers declared under this prefix (a SCAN of meta keys)."""
        pattern = f"{self.prefix}:{{*}}:meta"
        names = set()
        broker = self.client._broker
        with redis_errors(broker.url):
            async for key in broker.redis.scan_iter(match=pattern, count=500):
                text = key.decode(errors="replace")
                names.add(text[text.index("{") + 1 : text.rindex("}")])
        return sorted(n for n in names if "#" not in n)  # S#i: a shard's own meta hash

    def stream(self, serving: str, items: list[Any], **options: Any) -> AsyncGenerator[Event, None]:
        """``AsyncClient.stream``, typed as what it is: closing it withdraws its requests."""
        return cast(AsyncGenerator[Event, None], self.client.stream(serving, items, **options))

    async def submit(
        self, serving: str, items: Iterable[Any], options: Any, keep: float | None = None
    ) -> AsyncTicket:
        """``AsyncClient.submit`` with the request's options, its errors as HTTP ones."""
        try:
            return await self.client.submit(
                serving,
                items,
                batch_key=options.batch_key,
                timeout=options.timeout,
                priority=options.priority,
                keep=keep,
            )
        except QueueServeError as e:
            raise from_queueserve(e) from None
        except (TypeError, ValueError, OverflowError) as e:  # an item the codec cannot carry
            raise bad_request(str(e)) from None

    async def call(
        self,
        receive: Receive,
        serving: str,
        items: Iterable[Any],
        options: Any,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """``items``' results, the request withdrawn if the HTTP client disconnects first."""
        ticket = await self.submit(serving, items, options)
        watch = self._watches.watch(receive, ticket)
        try:
            return await ticket.result(return_exceptions=return_exceptions)
        except QueueServeError as e:
            raise from_queueserve(e) from None
        finally:
            watch.end()
