"""What the clients send for jobs (wire/job_record.py): a job's keep checked, and the records its
enqueue writes."""

from __future__ import annotations

from queueserve.broker.job_store import JobAt
from queueserve.client.calls import Call
from queueserve.client.outgoing import Outgoing
from queueserve.client.targets import Part, Target
from queueserve.wire.job_record import check_keep, group_key


def job_plan(target: Target, parts: list[Part], keep: float | None) -> int:
    """A job's keep in ms (0: no job), checked: a job is one request, to workers that keep
    jobs (older ones would dead-letter its header)."""
    if keep is None:
        return 0
    keep_ms = check_keep(keep)
    if target.keeps_jobs is False:
        raise ValueError(
            f"the workers of serving {target.keys.name!r} do not keep jobs ('job_keep' is not "
            "among the header_fields of its meta hash): upgrade them before submitting with "
            "keep="
        )
    if len(parts) != 1:
        raise ValueError(
            f"a job is one request, and these items go as {len(parts)} (one per batch "
            "key the serving's batch_key function gave): submit one job per batch key"
        )
    return keep_ms


def job_place_of(prefix: str, client_id: str, call: Call) -> tuple[str, str, int]:
    """A job's record group, request id and keep: what a cancel of its record takes."""
    return group_key(prefix, client_id, call.rid), str(call.rid), call.keep_ms


def jobs_at(prefix: str, client_id: str, group: list[Outgoing]) -> list[JobAt]:
    """The jobs among a group's requests (which enqueue_groups lists in the group's order):
    each one's index, record group, request id and keep."""
    return [
        (i, group_key(prefix, client_id, o.call.rid), str(o.call.rid), o.call.keep_ms)
        for i, o in enumerate(group)
        if o.call.keep_ms
    ]
