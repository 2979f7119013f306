"""A tenant's limits at the gateway (docs/gateway.md, "Tenants"): the highest priority it may
ask for, and how many items it may have waiting through this gateway (``max_queued``).

Only the tenant's own items count against its limit, so a tenant past it is refused (429) and
never another. Items are counted from their send until their request ends (answered, failed,
expired, withdrawn) or, for a job, until it is cancelled through this gateway. The count is this
process's: N gateway replicas admit up to N times ``max_queued`` (docs/gateway.md says so).
"""

from __future__ import annotations

from typing import Any

from queueserve.door.http_errors import ApiError
from queueserve.gateway.tenants import Tenant


class Quotas:
    def __init__(self) -> None:
        self._queued: dict[str, int] = {}  # tenant name -> items waiting
        self._by_ticket: dict[Any, Hold] = {}  # a counted job's ticket, until it is placed
        self._by_job: dict[str, Hold] = {}  # a counted job's client id

    def waiting(self, tenant: Tenant) -> int:
        return self._queued.get(tenant.name, 0)

    def admit(self, tenant: Tenant, items: int, priority: int) -> None:
        """403 when ``tenant`` may not ask for ``priority``; 429 when ``items`` more would
        pass its max_queued."""
        if priority > tenant.max_priority:
            raise ApiError(
                403,
                "priority_not_allowed",
                f"tenant {tenant.name!r} may ask for priorities up to {tenant.max_priority}, "
                f"got {priority}: send a lower one",
            )
        limit, waiting = tenant.max_queued, self.waiting(tenant)
        if limit is not None and waiting + items > limit:
            raise ApiError(
                429,
                "tenant_queue_full",
                f"tenant {tenant.name!r} has {waiting} items waiting here and may have "
                f"{limit}: {items} more would pass it; retry once some are answered",
                {"Retry-After": "1"},
            )

    def hold(self, tenant: Tenant, items: int, ticket: Any = None) -> Hold:
        """Count ``items`` against ``tenant`` until the hold is released; ``ticket``: the
        request's, when it may become a job (``job_placed``)."""
        self._queued[tenant.name] = self.waiting(tenant) + items
        hold = Hold(self, tenant, items, ticket)
        if ticket is not None:
            self._by_ticket[ticket] = hold
        return hold

    def job_placed(self, ticket: Any, job_id: str) -> None:
        """``ticket`` is job ``job_id``'s: its cancel here (``job_cancelled``) releases it."""
        hold = self._by_ticket.pop(ticket, None)
        if hold is not None and hold.held:
            hold.job_id = job_id
            self._by_job[job_id] = hold

    def job_cancelled(self, job_id: str) -> None:
        hold = self._by_job.get(job_id)
        if hold is not None:
            hold.release()

    def _release(self, hold: Hold) -> None:
        name = hold.tenant.name
        left = self._queued.get(name, 0) - hold.items
        if left > 0:
            self._queued[name] = left
        else:
            self._queued.pop(name, None)
        self._by_ticket.pop(hold.ticket, None)
        if hold.job_id is not None:
            self._by_job.pop(hold.job_id, None)


class Hold:
    """One request's items counted against its tenant, released once."""

    __slots__ = ("held", "items", "job_id", "quotas", "tenant", "ticket")

    def __init__(self, quotas: Quotas, tenant: Tenant, items: int, ticket: Any) -> None:
        self.quotas, self.tenant, self.items, self.ticket = quotas, tenant, items, ticket
        self.held = True
        self.job_id: str | None = None

    def release(self) -> None:
        if self.held:
            self.held = False
            self.quotas._release(self)
