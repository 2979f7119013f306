"""What the replier hands job.lua for a round trip's jobs (worker/pipeline/replies.py,
``_job_writes``): one message for a record group's rows while it is small, each job's own
messages once it is big (so each job is counted for its own bytes), and plain jobs by their
request id alone."""

from __future__ import annotations

from typing import Any

import msgpack

from queueserve.wire.codec import MsgpackCodec
from queueserve.wire.kinds import RESULTS
from queueserve.worker.pipeline.batching import Request
from queueserve.worker.pipeline.replies import MAX_SHARED_BYTES, compose

CODEC = MsgpackCodec()
INBOX = "qs:inbox:c"


def job_rows(*results: Any) -> list[Any]:
    out = []
    for rid, result in enumerate(results, start=1):
        request = Request(b"1-0", "s", rid, INBOX, 0.0, 1, "", False)
        request.remaining = 1
        request.fields = {"job_keep": 60_000}
        out.append((request, 0, 1, RESULTS, [result]))
    return out


def written(rows: list[Any]) -> tuple[str, list[bytes], list[Any], str]:
    out = compose(rows, CODEC, 1 << 30)
    [(group, (packed, plain, _per_item))] = out.jobs
    messages, jobs = msgpack.unpackb(packed, raw=True)  # (Redis's cmsgpack has no bin type)
    return group, messages, jobs, plain


def test_small_answers_share_the_inbox_s_message_and_go_as_plain_jobs() -> None:
    group, messages, jobs, plain = written(job_rows("a", "b"))
    assert group == "qs:jobs:c:0"
    assert len(messages) == 1 and jobs == [] and plain == "1 2"


def test_a_big_answer_is_kept_as_each_job_s_own_message_counted_for_its_own_bytes() -> None:
    big = "x" * (MAX_SHARED_BYTES + 1)
    _, messages, jobs, plain = written(job_rows(big, "small"))
    assert plain == "" and len(messages) == 2
    (rid1, final1, _, refs1, size1, _), (rid2, final2, _, refs2, size2, _) = jobs
    assert (rid1, refs1, rid2, refs2) == (b"1", [1], b"2", [2]) and final1 and final2
    assert size1 == len(messages[0]) > MAX_SHARED_BYTES and size2 == len(messages[1]) < 100
