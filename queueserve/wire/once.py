"""Idempotency keys: a request sent with ``idempotency_key=`` runs once per key and serving
while the key's record lives (docs/guarantees.md, "Once per key").

The record is one string, ``P:{S}:once:<key>`` (wire/keys.py's layout), in the slot of the
shard the request goes to::

    <digest>:<job id>

``digest`` is 32 hex digits, the BLAKE2b-128 of the request's batch key and encoded items
(``request_digest``): what tells a retry (same items) from a reuse of the key for other items.
``job id`` is the job the first request of the key became (wire/job_record.py): a keyed request is
a job, so any process follows its answer by that id. enqueue.lua reads the record and writes
it in the script that enqueues the request, so two senders of one key never both enqueue;
its TTL is the serving's ``idempotency_ttl``. A record costs its key's name and at most
``RECORD_MAX_BYTES`` of value, whatever the request's size.

enqueue.lua answers a keyed request it did not enqueue with one of these in the place of its
entry id (entry ids start with a digit): ``=<job id>`` (the key's request, to follow),
``!<job id>`` (the key was used for other items: IdempotencyConflict) or ``?`` (the record
holds what queueserve never writes: anyone can write to Redis; the request is refused, and
nothing else is touched).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence
from typing import Any, Final

from queueserve.wire.codec import pack_plain

MAX_KEY_BYTES: Final = 200
DIGEST_HEX: Final = 32
# a digest, ':' and the longest job id (wire/job_record.py: 64 + '-' + 18 digits)
RECORD_MAX_BYTES: Final = DIGEST_HEX + 1 + 64 + 1 + 18
SAME, CONFLICT, FORGED = b"="[0], b"!"[0], b"?"[0]


def check_key(key: object) -> str:
    """``key`` if it can be an idempotency key (a str of 1 to MAX_KEY_BYTES bytes of UTF-8,
    printable), else ValueError saying what one is."""
    if type(key) is str and key.isprintable() and 0 < len(key.encode()) <= MAX_KEY_BYTES:
        return key
    raise ValueError(
        f"idempotency_key must be a str of 1 to {MAX_KEY_BYTES} bytes of printable text "
        f"(a document id, an order number), got {key!r:.80}"
    )


def request_digest(batch_key: str, payload: bytes) -> str:
    """The digest a record holds of a request: its batch key and encoded items."""
    h = hashlib.blake2b(batch_key.encode(), digest_size=DIGEST_HEX // 2)
    h.update(b"\0")
    h.update(payload)
    return h.hexdigest()


def shard_of_key(key: str, shards: int) -> int:
    """The shard a keyed request goes to: the same for every call of the key, so its record
    and its entry share one slot wherever the call is sent from."""
    return zlib.crc32(key.encode()) % shards


def conflict_message(serving: str, key: str, job_id: str) -> str:
    return (
        f"idempotency key {key!r:.80} of serving {serving!r} was used for other items (job "
        f"{job_id}) within the serving's idempotency_ttl: a key names one request; use a new "
        "key for new items"
    )


def forged_message(serving: str, key: str, record_key: str) -> str:
    return (
        f"the record of idempotency key {key!r:.80} of serving {serving!r} ({record_key!r:.120}) "
        "holds a value queueserve never writes (someone else wrote it, or made it another type): "
        "the request was not sent; delete that key (DEL) and send it again"
    )


def once_spec(onces: Sequence[tuple[int, str, str, str, int]]) -> bytes:
    """enqueue.lua's last argument for keyed requests (index, record key, digest, job id,
    TTL ms): the TTL to use when the serving declares none, then per request its number
    (1 = the first), digest and job id."""
    flat: list[Any] = [onces[0][4]]
    for index, _, digest, job_id, _ in onces:
        flat += (index + 1, digest, job_id)
    return pack_plain(flat)
