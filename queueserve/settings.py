"""The one settings object: defaults, overridden by ``QUEUESERVE_*`` environment variables.

Built explicitly (``Settings()``), never at import time. Unknown ``QUEUESERVE_*`` options are not
silently dropped: ``Settings(**options)`` rejects names it does not know.
"""

from __future__ import annotations

import math
import re

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from queueserve.broker.urls import has_unencoded_userinfo, redact_url
from queueserve.options.units import parse_duration

_PREFIX = re.compile(r"[A-Za-z0-9_.\-]+")
REDIS_SCHEMES = (
    "redis",
    "rediss",
    "unix",
    "redis+cluster",
    "rediss+cluster",
    "redis+sentinel",
    "rediss+sentinel",
)


class Settings(BaseSettings):
    """Connection and namespace settings shared by clients, workers and the CLI."""

    # hide_input_in_errors: a ValidationError would otherwise print the raw value, a Redis
    # URL with its password included
    model_config = SettingsConfigDict(
        env_prefix="QUEUESERVE_", extra="forbid", hide_input_in_errors=True
    )

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis to use (redis://, rediss://, unix://); env QUEUESERVE_REDIS_URL.",
    )
    prefix: str = Field(
        default="qs",
        description="Namespace of every key queueserve writes; env QUEUESERVE_PREFIX.",
    )
    default_timeout: float | None = Field(
        default=None,
        description="Seconds (or '30s', '2m') that bounds every client call made without "
        "timeout=; unset: such calls wait until answered. Env QUEUESERVE_DEFAULT_TIMEOUT.",
    )

    wait_for_worker: bool = Field(
        default=False,
        description="Clients wait for a serving no worker declared yet instead of raising "
        "UnknownServing (clients started before their workers); env "
        "QUEUESERVE_WAIT_FOR_WORKER.",
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        return check_redis_url(value)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        return check_prefix(value)

    @field_validator("default_timeout", mode="before")
    @classmethod
    def _default_timeout(cls, value: object) -> float | None:
        if value is None or value == "":
            return None
        if not isinstance(value, str | int | float):
            raise ValueError(f"default_timeout must be seconds or '30s', got {value!r}")
        seconds = parse_duration(value, what="QUEUESERVE_DEFAULT_TIMEOUT")
        if seconds <= 0 or math.isinf(seconds):
            raise ValueError(
                f"QUEUESERVE_DEFAULT_TIMEOUT must be a duration > 0 such as 30 or '2m', got "
                f"{value!r}; unset it to let calls without timeout= wait until answered"
            )
        return seconds


def check_timeout(timeout: object, *, what: str = "timeout") -> float | None:
    """``timeout`` as seconds > 0, or None (no limit); anything else is the caller's mistake,
    reported now rather than as a Timeout later."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"{what} must be seconds (a number > 0) or None, got {timeout!r}")
    if math.isnan(timeout) or timeout <= 0 or math.isinf(timeout):
        raise ValueError(
            f"{what} must be a finite number of seconds > 0, got {timeout!r}; "
            "use None to wait until answered"
        )
    return float(timeout)


def call_timeout(timeout: object, default: float | None) -> float | None:
    """A call's timeout, checked (``check_timeout``); ``default`` (the client's
    QUEUESERVE_DEFAULT_TIMEOUT) when the call gives none."""
    checked = check_timeout(timeout)
    return default if checked is None else checked


def check_prefix(prefix: object) -> str:
    """``prefix`` when it is a key namespace (letters, digits, '_', '.', '-'); else a
    ValueError. The same check for QUEUESERVE_PREFIX, ``--prefix``, ``Client(prefix=)`` and
    ``Worker(prefix=)``: a ':' or a brace would let keys of one prefix name another's, or
    break the hash tags that keep a serving's keys in one cluster slot."""
    if not isinstance(prefix, str) or _PREFIX.fullmatch(prefix) is None:
        raise ValueError(
            f"prefix {prefix!r:.80} is not a key namespace: use only letters, digits, '_', '.' "
            "or '-' (for example 'qs' or 'shop-prod')"
        )
    return prefix


def check_redis_url(url: str) -> str:
    """``url`` when redis-py can use it; else a ValueError saying what a Redis URL looks like."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in REDIS_SCHEMES:
        raise ValueError(
            f"{redact_url(url)!r} is not a Redis URL: it must start with redis://, rediss://, "
            "unix://, redis+cluster:// or redis+sentinel:// (for example "
            "redis://localhost:6379/0); pass --redis-url or set QUEUESERVE_REDIS_URL"
        )
    if has_unencoded_userinfo(url):
        raise ValueError(
            f"the Redis URL {redact_url(url)!r} has a password or user name holding '/', '?' "
            "or '#' as it is, which ends the address early (the rest would be read as a path "
            "or a query, and shown in logs): percent-encode the password, '/' as %2F, '?' as "
            "%3F, '#' as %23 (urllib.parse.quote(password, safe=''))"
        )
    return url
