"""Tenants: who the gateway's callers are (docs/gateway.md, "Tenants").

``queueserve gateway --tenants FILE`` (or ``QUEUESERVE_GATEWAY_TENANTS``) names a TOML file with
one table per tenant::

    [tenants.acme]
    token = "tok-acme"       # or token_sha256 = "<hex>": the file need not hold the secret
    weight = 1               # share of service when tenants compete
    max_queued = 10000       # items it may have waiting in this gateway (429 past it)
    max_priority = 9         # the highest priority it may ask for

The bearer token names the tenant. ``--token`` is the one-tenant shorthand (the tenant
``default``); with neither, the gateway is open and every caller is the tenant ``anonymous``.
``SIGHUP`` reloads the file: new requests see the new tenants, connections stay open, and a file
that does not load leaves the tenants in force (its error logged).

A presented token is looked up by its SHA-256 digest: the lookup of a digest tells a caller
nothing about the tokens there are (finding one by timing means finding a SHA-256 preimage).
"""

from __future__ import annotations

import hashlib
import logging
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import pydantic
from starlette.types import ASGIApp, Receive, Scope, Send

from queueserve.door.auth import OPEN_PATHS, presented_token, refused
from queueserve.door.http_errors import error_response
from queueserve.gateway.paths import route_path
from queueserve.wire.priority import MAX_PRIORITY
from queueserve.wire.tenants import TENANT_NAME

log = logging.getLogger(__name__)

SCOPE_KEY = "queueserve.tenant"  # where the auth layer leaves the caller's Tenant
MAX_TENANTS = 10_000  # a file is configuration, not data: this bounds a mistaken one
MAX_WEIGHT = 1000.0


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant: its name (travels in each request's header to the worker), its share of
    service, how many items it may have waiting in this gateway, its highest priority."""

    name: str
    weight: float = 1.0
    max_queued: int | None = None  # None: no limit of its own
    max_priority: int = MAX_PRIORITY


ANONYMOUS = Tenant("anonymous")  # every caller of an open gateway (no --token, no --tenants)
DEFAULT = Tenant("default")  # the caller holding --token


class _Entry(pydantic.BaseModel, extra="forbid"):
    """One ``[tenants.NAME]`` table as the file gives it."""

    token: Annotated[str, pydantic.Field(min_length=1, max_length=4096)] | None = None
    token_sha256: Annotated[str, pydantic.Field(pattern=r"^[0-9a-fA-F]{64}$")] | None = None
    weight: Annotated[float, pydantic.Field(gt=0, le=MAX_WEIGHT, allow_inf_nan=False)] = 1.0
    max_queued: Annotated[pydantic.StrictInt, pydantic.Field(ge=1, le=10**12)] | None = None
    max_priority: Annotated[pydantic.StrictInt, pydantic.Field(ge=0, le=MAX_PRIORITY)] = (
        MAX_PRIORITY
    )

    def digest(self, name: str) -> bytes:
        if (self.token is None) == (self.token_sha256 is None):
            raise ValueError(f"tenant {name!r}: give exactly one of token and token_sha256")
        if self.token is not None:
            return hashlib.sha256(self.token.encode()).digest()
        assert self.token_sha256 is not None
        return bytes.fromhex(self.token_sha256)


def parse_tenants(text: str, source: str = "the tenants file") -> dict[bytes, Tenant]:
    """Token digest -> Tenant from a tenants file's TOML; ValueError saying what is wrong
    (the file, the tenant, the field)."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{source} is not TOML: {e}") from None
    extra = set(document) - {"tenants"}
    if extra:
        raise ValueError(f"{source}: unknown top-level keys {sorted(extra)}: use [tenants.NAME]")
    tables = document.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"{source} names no tenant: add a [tenants.NAME] table")
    if len(tables) > MAX_TENANTS:
        raise ValueError(f"{source} names {len(tables)} tenants, more than {MAX_TENANTS}")
    tenants: dict[bytes, Tenant] = {}
    for name, table in tables.items():
        digest, tenant = _tenant(name, table, source)
        if digest in tenants:
            raise ValueError(
                f"{source}: tenants {tenants[digest].name!r} and {name!r} have the same token"
            )
        tenants[digest] = tenant
    return tenants


def _tenant(name: str, table: Any, source: str) -> tuple[bytes, Tenant]:
    """One ``[tenants.NAME]`` table: its token's digest and the tenant; ValueError."""
    if not TENANT_NAME.fullmatch(name):
        raise ValueError(
            f"{source}: tenant name {name[:80]!r} must be 1 to 64 letters, digits, '_', "
            "'-' or '.', starting with a letter or digit"
        )
    if not isinstance(table, dict):
        raise ValueError(f"{source}: tenants.{name} must be a table")
    try:
        entry = _Entry.model_validate(table)
        digest = entry.digest(name)
    except pydantic.ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in e.errors())
        raise ValueError(f"{source}: tenants.{name}: {problems}") from None
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    return digest, Tenant(name, entry.weight, entry.max_queued, entry.max_priority)


class Tenants:
    """The gateway's tenants: from a file (``from_file``, reloadable), one token
    (``single``), or none (``open``: every caller is ``ANONYMOUS``)."""

    def __init__(self, by_digest: dict[bytes, Tenant] | None, path: Path | None = None) -> None:
        self._by_digest = by_digest  # None: open
        self.path = path

    @classmethod
    def open(cls) -> Tenants:
        return cls(None)

    @classmethod
    def single(cls, token: str) -> Tenants:
        if not token:
            raise ValueError("the token must not be empty; leave it out for none")
        return cls({hashlib.sha256(token.encode()).digest(): DEFAULT})

    @classmethod
    def from_file(cls, path: str | Path) -> Tenants:
        path = Path(path)
        return cls(parse_tenants(_read(path), str(path)), path)

    @classmethod
    def of_options(cls, token: str | None, tenants: Tenants | str | Path | None) -> Tenants:
        """The tenants of ``create_app(token=..., tenants=...)``: a file's, one token's, or
        none (open)."""
        if token is not None and tenants is not None:
            raise ValueError("give token or tenants, not both: a token is the one-tenant shorthand")
        if isinstance(tenants, Tenants):
            return tenants
        if tenants is not None:
            return cls.from_file(tenants)
        return cls.single(token) if token is not None else cls.open()

    @property
    def required(self) -> bool:
        """Whether a request must carry a token."""
        return self._by_digest is not None

    def names(self) -> list[str]:
        return sorted(t.name for t in (self._by_digest or {}).values())

    def weights(self) -> dict[str, float]:
        """Each tenant's weight (what workers share service by: wire/tenants.py)."""
        return {t.name: t.weight for t in (self._by_digest or {}).values()}

    def of(self, scope: Scope) -> Tenant | None:
        """The tenant whose token the request carries (``Authorization: Bearer``, read as
        ``Token.allows`` reads it); None when it carries none of theirs."""
        tenants = self._by_digest
        if tenants is None:
            return ANONYMOUS
        token = presented_token(scope)
        if token is None:
            return None
        return tenants.get(hashlib.sha256(token).digest())

    def reload(self) -> bool:
        """Read the file again; the tenants in force stay when it does not load (logged).
        True when the new file is in force."""
        if self.path is None:
            return False
        try:
            tenants = parse_tenants(_read(self.path), str(self.path))
        except (OSError, ValueError) as e:
            log.error("gateway: tenants not reloaded, the ones in force stay: %s", e)
            return False
        self._by_digest = tenants  # one reference swapped: a request sees the old or the new
        log.info("gateway: tenants reloaded from %s: %s", self.path, ", ".join(self.names()))
        return True


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read the tenants file {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the tenants file {str(path)!r} is not UTF-8") from None


def caller(scope: Scope) -> Tenant:
    """The tenant the auth layer found for this request (``ANONYMOUS`` on an open gateway)."""
    tenant: Any = scope.get(SCOPE_KEY)
    return tenant if isinstance(tenant, Tenant) else ANONYMOUS


class TenantAuth:
    """ASGI middleware: a request to any route but ``OPEN_PATHS`` must carry a tenant's token
    (401 otherwise); the tenant is left in the scope for the routes (``caller``)."""

    def __init__(self, app: ASGIApp, tenants: Tenants) -> None:
        self.app = app
        self.tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        tenant = self.tenants.of(scope)
        if tenant is None:
            await error_response(refused())(scope, receive, send)
            return
        scope[SCOPE_KEY] = tenant
        await self.app(scope, receive, send)
