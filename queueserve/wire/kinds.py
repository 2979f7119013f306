"""What a reply slice is (its kind), and for an error slice, which error (its error kind):
the ``kind`` field of a reply row and the last element of an ERROR body (wire/protocol.py,
"Reply"; built in wire/reply.py and wire/error.py)."""

from __future__ import annotations

from typing import Final

# Reply slice kinds.
RESULTS: Final = 0
BATCHED: Final = 1
ERROR: Final = 2
DROP: Final = 3  # worker-internal: the caller cancelled; ack without replying
EVENT: Final = 4  # worker-internal: publish a streamed event (offset field holds its seq)
STEPS: Final = 5
JOB_HOOK: Final = 6  # worker-internal: a hook event of a job's batch, kept in its record

# Error kinds carried in an ERROR slice, so the client raises the matching queueserve error.
ERR_REMOTE: Final = "remote"
ERR_TIMEOUT: Final = "timeout"
ERR_BAD_REQUEST: Final = "bad_request"
ERR_DEAD_LETTER: Final = "dead_letter"
