"""Tenants on the wire: a tenant's name, its lane, and the tenants' weights as workers read
them.

**Names.** A tenant's name (``TENANT_NAME``, ``check_tenant``) travels in a request's header
(field ``tenant``) and names it in the gateway's tenants file, a log line and a metric label.

**Lanes.** A request a tenant sends with batch key K travels with the key ``K + LANE + tenant``
(``lane_key``): each tenant's requests of one key wait in a stream of their own, where no other
tenant's backlog is ahead of them, and a worker shares service between tenants, then between a
tenant's lanes (read.lua, worker/pipeline/batching.py and shares.py), by the tenant's weight.
The batch function is handed K alone (``split_lane``); a batch a lane cannot fill is filled
from other tenants' lanes of K.

**Weights.** ``P:tenants`` (wire/keys.py) maps a tenant's name to its weight, as the gateways'
tenants files give it (gateway/tenants.py writes it at start and on SIGHUP). Anyone may write
the hash: a worker takes fields that are a tenant's name with a decimal weight in (0, 1000],
at most MAX_TENANT_WEIGHTS of them, and weight 1 for every other tenant.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

# A tenant's name (header field "tenant"; the gateway's tenants file): short, and safe in a
# log line or a metric label.
TENANT_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_tenant(tenant: object) -> str:
    """``tenant`` if it is a tenant's name, else ValueError saying what one is."""
    if type(tenant) is str and TENANT_NAME.fullmatch(tenant):
        return tenant
    raise ValueError(
        "tenant must be 1 to 64 letters, digits, '_', '-' or '.', starting with a letter or "
        f"digit, got {tenant!r:.80}"
    )


LANE: Final = "\x1f"  # between a batch key and its tenant; read from the right
MAX_TENANT_WEIGHTS: Final = 1000
MAX_WEIGHT: Final = 1000.0
_DECIMAL = re.compile(rb"[0-9]{1,4}(\.[0-9]{1,6})?")


def lane_key(batch_key: str, tenant: str) -> str:
    """The key ``tenant``'s requests of ``batch_key`` travel with."""
    return f"{batch_key}{LANE}{tenant}"


def split_lane(key: str) -> tuple[str, str | None]:
    """(batch key, tenant) of a stream's key; (key, None) for a key that names no tenant."""
    batch_key, sep, tenant = key.rpartition(LANE)
    if sep and TENANT_NAME.fullmatch(tenant):
        return batch_key, tenant
    return key, None


def encode_weights(weights: Mapping[str, float]) -> dict[str, str]:
    """``P:tenants``' fields for ``weights`` (names checked by the caller)."""
    return {name: f"{weight:.6f}".rstrip("0").rstrip(".") for name, weight in weights.items()}


def parse_weights(raw: Mapping[bytes | str, bytes | str]) -> dict[str, float]:
    """The weights other than 1 of ``P:tenants``' fields, each checked (the rest ignored)."""
    weights: dict[str, float] = {}
    for name, value in raw.items():
        if len(weights) >= MAX_TENANT_WEIGHTS:
            break
        if not (isinstance(value, bytes) and _DECIMAL.fullmatch(value)):
            continue
        try:
            tenant = name.decode("ascii") if isinstance(name, bytes) else name
        except UnicodeDecodeError:
            continue
        weight = float(value)
        if TENANT_NAME.fullmatch(tenant) and 0 < weight <= MAX_WEIGHT and weight != 1.0:
            weights[tenant] = weight
    return weights
