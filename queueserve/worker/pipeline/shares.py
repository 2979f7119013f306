"""How a partition's keys share it: batch keys' weights (``batch_key_weights``), tenants'
weights (``P:tenants``) for their lanes (wire/tenants.py), and read.lua's marks of both
(docs/usage.md, "Batch keys, fairness and priorities"; docs/gateway.md, "Tenants")."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from queueserve.wire.tenants import split_lane

log = logging.getLogger(__name__)

TURNS_KEPT = 1000  # tenants whose next turn is remembered before past ones are forgotten
TIE_SHARE = 1e-6  # of a lane's lead over its tenant's turn, what it ranks before that turn


class Shares:
    """The weights the assembler ranks keys by: a key of weight w comes round w times as
    often as a key of weight 1 while both have work; a tenant's lane of a key has its key's
    weight times its tenant's. Fair across tenants before keys: a tenant's lanes take turns
    as one key would, so one that spreads its requests over n batch keys gets one tenant's
    share, not n."""

    def __init__(self) -> None:
        self._keys: Mapping[str, float] = {}
        self._tenants: Mapping[str, float] = {}
        self._turns: dict[str, float] = {}  # tenant -> when its lanes' next turn starts
        # read.lua ranks weighted streams so too: '=<key>=<weight>', '~<tenant>=<weight>'
        self.marks: list[str] = []

    @property
    def keys(self) -> Mapping[str, float]:
        return self._keys

    @keys.setter
    def keys(self, weights: Mapping[str, float]) -> None:
        self._keys = {key: w for key, w in weights.items() if w != 1.0}
        self._mark()

    @property
    def tenants(self) -> Mapping[str, float]:
        return self._tenants

    @tenants.setter
    def tenants(self, weights: Mapping[str, float]) -> None:
        self._tenants = {tenant: w for tenant, w in weights.items() if w != 1.0}
        self._mark()

    def _mark(self) -> None:
        self.marks = [f"={key}={w!r}" for key, w in self._keys.items()] + [
            f"~{tenant}={w!r}" for tenant, w in self._tenants.items()
        ]

    def lane_turn(self, tenant: str, turn: float) -> float:
        """When the turn of a lane of ``tenant`` starts: its own (``turn``), and not before
        its tenant's; of the tenant's lanes held back so, the one whose own turn came first
        goes first (ranked a millionth of its lead before the tenant's turn), so its lanes
        take turns among themselves."""
        at = self._turns.get(tenant)
        if at is None or turn >= at:
            return turn
        return at - (at - turn) * TIE_SHARE

    def served(self, tenant: str, end: float, now: float, restart: float) -> None:
        """One of ``tenant``'s lanes gave a batch expected to end at ``end``: its lanes' next
        turn starts then (a tenant of weight w: 1/w of the way there from its last turn, as a
        weighted key's; one whose last turn is older than ``restart`` starts anew)."""
        turns = self._turns
        weight = self._tenants.get(tenant, 1.0)
        last = turns.get(tenant, now)
        if last < restart:
            last = now
        turns[tenant] = end if weight == 1.0 else last + (end - last) / weight
        if len(turns) > TURNS_KEPT:  # what is past restarts anyway: forgotten in bulk
            self._turns = {t: at for t, at in turns.items() if at > now}

    def weight_of(self, key: str) -> float:
        if not (self._keys or self._tenants):
            return 1.0
        batch_key, tenant = split_lane(key)
        weight = self._keys.get(batch_key, 1.0)
        return weight * self._tenants.get(tenant, 1.0) if tenant else weight


def share_tenants(
    assembler: object, weights: Mapping[str, float], cond: threading.Condition, serving: str
) -> None:
    """Hand the tenants' weights as last read (``P:tenants``) to the assembler's shares (or a
    step serving's queue's), when they changed."""
    shares = getattr(assembler, "shares", None)
    if not isinstance(shares, Shares) or weights == shares.tenants:
        return
    with cond:
        shares.tenants = weights
    log.info("serving %s: tenants' weights now %s", serving, dict(weights) or "all 1")
