"""What the clients send for jobs (wire/jobs.py): a job's id, its keep checked, and the
records written around its enqueue (created before it, placed after)."""

from __future__ import annotations

from queueserve.broker.jobs import NewJob, Placed
from queueserve.client.outgoing import Outgoing
from queueserve.client.targets import Part, Target
from queueserve.wire.jobs import check_keep, job_key


def job_id(client_id: str, rid: int) -> str:
    """The id of a client's request as a job: its ticket's id, unique across clients."""
    return f"{client_id}-{rid}"


def job_plan(target: Target, parts: list[Part], keep: float | None) -> int:
    """A job's keep in ms (0: no job), checked: a job is one request, to workers that keep
    jobs (older ones would dead-letter its header)."""
    if keep is None:
        return 0
    keep_ms = check_keep(keep)
    if target.keeps_jobs is False:
        raise ValueError(
            f"the workers of serving {target.keys.name!r} do not keep jobs ('job' is not among "
            "the header_fields of its meta hash): upgrade them before submitting with keep="
        )
    if len(parts) != 1:
        raise ValueError(
            f"a job is one request, and these items go as {len(parts)} (one per batch "
            "key the serving's batch_key function gave): submit one job per batch key"
        )
    return keep_ms


def new_jobs(prefix: str, client_id: str, group: list[Outgoing]) -> list[NewJob]:
    """Records of a group's jobs, written before it is enqueued."""
    return [
        NewJob(
            job_key(prefix, job_id(client_id, o.call.rid)),
            o.call.n,
            o.call.keep_ms,
            o.call.keys.name,
        )
        for o in group
        if o.call.keep_ms
    ]


def placed_jobs(prefix: str, client_id: str, group: list[Outgoing]) -> list[Placed]:
    """Where a group's jobs wait, once enqueued (no entry: refused, its record goes)."""
    return [
        (
            job_key(prefix, job_id(client_id, o.call.rid)),
            o.call.keys.stream(o.call.batch_key, o.call.priority),
            o.call.entry_id,
        )
        for o in group
        if o.call.keep_ms
    ]
