"""The one settings object: defaults, overridden by ``QUEUESERVE_*`` environment variables.

Built explicitly (``Settings()``), never at import time. Unknown ``QUEUESERVE_*`` options are not
silently dropped: ``Settings(**options)`` rejects names it does not know.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Connection and namespace settings shared by clients, workers and the CLI."""

    model_config = SettingsConfigDict(env_prefix="QUEUESERVE_", extra="forbid")

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis to use (redis://, rediss://, unix://); env QUEUESERVE_REDIS_URL.",
    )
    prefix: str = Field(
        default="qs",
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="Namespace of every key queueserve writes; env QUEUESERVE_PREFIX.",
    )
