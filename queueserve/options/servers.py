"""The options of ``queueserve gateway`` and ``queueserve dashboard``, declared once.

Each field of ``GatewayOptions`` is a flag ``--<name>`` of ``queueserve gateway`` and a
variable ``QUEUESERVE_GATEWAY_<NAME>``; each of ``DashboardOptions`` one of ``queueserve
dashboard`` and ``QUEUESERVE_DASHBOARD_<NAME>`` (docs/operations.md lists every variable, and
tests/unit/test_options.py holds the flags, the variables and that table to these fields). A
flag wins over its variable, which wins over the default. The servers take the model and read
no variable themselves. No I/O here: ``of`` is handed the environment.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field

from queueserve.options.serving_options import validated
from queueserve.options.units import checked_by, count, duration, from_text

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a few thousand texts to embed
# A browser origin as a page's Origin header writes it, or * (any) or null (an opaque one)
ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/\s]+/?$|^\*$|^null$", re.IGNORECASE)


def _origins(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(o, str) for o in value):
        raise ValueError(f"allow_origin must be origins, got {value!r:.100}")
    for origin in value:
        if not ORIGIN.match(origin.strip()):
            raise ValueError(
                f"allowed origin {origin!r:.100} is not one: write it as a browser sends it, "
                "scheme://host[:port] (https://app.example.com), or * for any"
            )
    return tuple(o.strip() for o in value)


def _level(value: Any) -> str:
    level = value.upper() if isinstance(value, str) else value
    if level not in LEVELS:
        raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {value!r:.40}")
    return str(level)


Origins = Annotated[tuple[str, ...], checked_by(_origins)]
Level = Annotated[str, checked_by(_level)]
Seconds = Annotated[float, duration()]


Port = Annotated[int, count(0, 65535)]


def _port(default: int) -> Any:
    return Field(default, description="port (0: any free one)")


def _token(what: str) -> Any:
    # a flag's value shows in ps; a variable's does not
    return Field(None, description=f"{what}; prefer the variable: arguments show in ps")


def _keep_alive(default: float) -> Any:
    return Field(default, description="close a kept-alive connection idle this long")


def _most(default: int) -> Any:
    return Field(
        default,
        description="connections held at once; one more replaces the one waiting longest "
        "on its client",
    )


def _per_client(default: int) -> Any:
    return Field(
        default,
        description="connections one client address may hold; 0: no cap (behind a proxy, "
        "every connection is the proxy's)",
    )


class ServerOptions(BaseModel):
    """What both servers take: where they listen, their token, their connections' deadlines
    and caps (queueserve/door/connections.py), the browser origins that may write besides
    their own (crosssite.py), their log level."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ENV: ClassVar[str]  # the variables' prefix: QUEUESERVE_GATEWAY_, QUEUESERVE_DASHBOARD_

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 for every interface)")
    header_timeout: Seconds = Field(
        10.0, description="close a connection whose request head has not arrived within this"
    )
    body_timeout: Seconds = Field(
        30.0, description="close one whose request body has not arrived within this of its head"
    )
    allow_origin: Origins = Field(
        (),
        description="browser origins (https://app.example.com; * for any) whose pages may "
        "write besides the server's own (flag repeatable; variable comma-separated)",
    )
    log_level: Level = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")

    @classmethod
    def of(cls, given: Mapping[str, Any], environ: Mapping[str, str]) -> Self:
        """The options ``given`` (flags; None for one left out), each other one from its
        variable in ``environ``, else its default; a ValueError saying what was wrong, and
        for a variable's value, which variable."""
        values: dict[str, Any] = {}
        for name, field in cls.model_fields.items():
            variable = f"{cls.ENV}{name.upper()}"
            text = environ.get(variable, "")
            if given.get(name) is not None or not text.strip():
                continue
            try:
                values[name] = from_text(name, field.annotation, text)
                validated(cls, {name: values[name]})
            except (TypeError, ValueError) as e:
                raise ValueError(f"{variable}={text!r:.60}: {e}") from None
        values.update({k: v for k, v in given.items() if v is not None and k in cls.model_fields})
        return validated(cls, values)

    @classmethod
    def variable(cls, name: str) -> str:
        return f"{cls.ENV}{name.upper()}"


class GatewayOptions(ServerOptions):
    """``queueserve gateway`` (docs/gateway.md)."""

    ENV: ClassVar[str] = "QUEUESERVE_GATEWAY_"

    port: Port = _port(8000)
    token: str | None = _token("require 'Authorization: Bearer TOKEN' (none: no auth)")
    tenants: str | None = Field(
        None,
        description="a TOML file of tenants, each with its token, weight, max_queued and "
        "max_priority (SIGHUP reloads it; docs/gateway.md)",
    )
    max_body_bytes: Annotated[int, count(1)] = Field(
        DEFAULT_MAX_BODY_BYTES, description="largest request body, in bytes"
    )
    models: tuple[str, ...] = Field(
        (),
        description="MODEL=SERVING: an OpenAI model name served by a serving (flag --model, "
        "repeatable; variable comma-separated); other names are taken as serving names",
    )
    shutdown_timeout: Seconds = Field(10.0, description="how long SIGTERM waits for open requests")
    keep_alive_timeout: Seconds = _keep_alive(75.0)  # longer than load balancers keep idle
    max_connections: Annotated[int, count(1)] = _most(10_000)
    max_connections_per_client: Annotated[int, count(0)] = _per_client(1_000)


class DashboardOptions(ServerOptions):
    """``queueserve dashboard`` (docs/operations.md, "Dashboard"): an operator's page, from a
    browser or two, so fewer connections than the gateway's callers."""

    ENV: ClassVar[str] = "QUEUESERVE_DASHBOARD_"

    port: Port = _port(8100)
    token: str | None = _token(
        "needed for replay, drop and config set (none: the page is read-only)"
    )
    read_token: str | None = Field(
        None,
        description="needed to read the page's data (none: reading is open; the token reads too)",
    )
    keep_alive_timeout: Seconds = _keep_alive(5.0)
    max_connections: Annotated[int, count(1)] = _most(1_000)
    max_connections_per_client: Annotated[int, count(0)] = _per_client(100)


SERVERS: dict[str, type[ServerOptions]] = {
    "gateway": GatewayOptions,
    "dashboard": DashboardOptions,
}
