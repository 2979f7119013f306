"""Redis key names and the wire format: the one place that knows either.

Key layout (``P`` is the configurable prefix, default ``qs``; ``S`` the serving name; ``K`` a batch
key). Every key of one serving shares the hash tag ``{S}``, so one serving lives in one Redis
Cluster slot and the Lua scripts below may touch all of its keys atomically::

    P:{S}:in:K        stream   one entry per request (fields h, p); consumer group "qs"
    P:{S}:keys        set      batch keys seen so far (workers discover new keys from it)
    P:{S}:queued      string   items admitted and not yet acked (admission counter, max_queue)
    P:{S}:meta        hash     the serving's options in force, as workers declared them
    P:{S}:config      hash     options changed at run time (`queueserve config set`)
    P:{S}:workers     zset     consumer name -> last heartbeat, unix ms (TTL)
    P:{S}:dead        stream   dead letters: requests that could not be served, with the reason
    P:{S}:cancel      channel  "stream\nentry id" of requests cancelled after a worker read them
    P:inbox:C         list     replies for client C, one element per (client, batch) (TTL)
    P:events:C        channel  streamed events (hooks, generator steps) for client C
    P:worker:W        hash     registry record of worker process W (TTL)

Request stream entry:
    h  msgpack [version, request_id, n_items, reply_to, deadline_ms, codec(, events)]
       request_id is an int unique within the client whose inbox is reply_to;
       deadline_ms is unix time in ms, 0 = none; events, when present and not empty, is the
       pub/sub channel of the caller's client for streamed events (such requests never split).
    p  the items, a list encoded with the serving's codec

Reply (one list element for one client and one batch): a codec tag byte followed by the codec's
encoding of ``[[request_id, offset, count, kind, body(, events_total)], ...]`` (events_total:
for streamed requests, how many events were published before this reply), where kind is
    RESULTS  body is a list of ``count`` results
    BATCHED  body is an array/tensor, or a dict of them, whose first axis has ``count`` rows
    ERROR    body is [remote_type, message, traceback, error_kind] for all ``count`` items
    STEPS    like RESULTS, each result being the list of an item's generator steps

Event (published on ``P:events:C``): codec tag + encoding of ``[request_id, seq, *body]`` where
body is ``["h", hook, payload, start, size]`` (start/size: the caller's items in the batch) or
``["o", RESULTS, values, offset, count]`` (a generator step for items offset:offset+count).
"""

from __future__ import annotations

from typing import Final

WIRE_VERSION: Final = 1
GROUP: Final = "qs"

# Reply slice kinds.
RESULTS: Final = 0
BATCHED: Final = 1
ERROR: Final = 2
DROP: Final = 3  # worker-internal: the caller cancelled; ack without replying
EVENT: Final = 4  # worker-internal: publish a streamed event (offset field holds its seq)
STEPS: Final = 5

# Error kinds carried in an ERROR slice, so the client raises the matching queueserve error.
ERR_REMOTE: Final = "remote"
ERR_TIMEOUT: Final = "timeout"
ERR_BAD_REQUEST: Final = "bad_request"
ERR_DEAD_LETTER: Final = "dead_letter"

# Header field positions.
H_VERSION, H_ID, H_COUNT, H_REPLY_TO, H_DEADLINE, H_CODEC, H_EVENTS = range(7)


class Keys:
    """Key names of one serving under one prefix."""

    __slots__ = (
        "_stream_prefix", "cancel", "config", "dead", "keys", "meta", "name", "prefix", "queued",
        "workers",
    )

    def __init__(self, prefix: str, serving: str) -> None:
        if "{" in serving or "}" in serving or ":" in serving:
            raise ValueError(
                f"serving name {serving!r} may not contain '{{', '}}' or ':'; "
                "use letters, digits, '-', '_' or '.'"
            )
        tag = f"{prefix}:{{{serving}}}"
        self.prefix = prefix
        self.name = serving
        self.keys = f"{tag}:keys"
        self.queued = f"{tag}:queued"
        self.meta = f"{tag}:meta"
        self.workers = f"{tag}:workers"
        self.dead = f"{tag}:dead"
        self.cancel = f"{tag}:cancel"
        self.config = f"{tag}:config"
        self._stream_prefix = f"{tag}:in:"

    def stream(self, batch_key: str) -> str:
        return self._stream_prefix + batch_key

    def batch_key_of(self, stream: str) -> str:
        return stream[len(self._stream_prefix) :]


def inbox_key(prefix: str, client_id: str) -> str:
    return f"{prefix}:inbox:{client_id}"


def events_channel(prefix: str, client_id: str) -> str:
    return f"{prefix}:events:{client_id}"


def worker_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}:worker:{worker_id}"
