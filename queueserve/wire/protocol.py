"""The wire format: what a request entry, a pack, a reply and an event hold (the keys they
travel in are wire/keys.py's; reply and error kinds wire/kinds.py's).

Request stream entry:
    h  msgpack [version, request_id, n_items, reply_to, deadline_ms, codec(, events(, priority
       (, fields)))] (wire/request.py)
       request_id is an int unique within the client whose inbox is reply_to;
       deadline_ms is unix time in ms, 0 = none; events, when present and not empty, is the
       pub/sub channel of the caller's client for streamed events (such requests never split);
       priority (0..9, larger first) is present only when not 0, so entries of priority 0 stay
       readable by workers that predate it. It is also in the stream's name, which a
       redelivery keeps. fields, present only when not empty, is a map of optional fields
       (trace context, a job's keep, tenant): the header grows there without a version bump.
    p  the items, a list encoded with the serving's codec
    a  the items admission counted (enqueue.lua), released by the entry's ack
    r  present on the entries split.lua makes of a reclaimed pack: the request ran before,
       so it runs again as a replay

Pack entry (several requests in one entry; enqueue.lua writes them once workers declared
``pack_items`` in the meta hash):
    a  the items of all its requests
    k  msgpack ``[[h, p, a], ...]``: each request's header, payload and admitted items (byte
       strings) as an entry of its own would carry them. A worker that reclaims a pack splits
       it into such entries (split.lua) instead of running it.
    w  never stored by queueserve: read.lua adds it to a pack it reads, from the pack's field
       of P:{S}:withdrawn: the ids of its requests cancelled before the read, "rid,rid,..."
       (wire/cancel.py). The worker answers none of them and acks the pack as ever. (One
       stored by anyone concerns that entry's own requests alone.)

Reply (one list element for one client and one batch): a codec tag byte followed by the codec's
encoding of ``[[request_id, offset, count, kind, body(, events_total(, run))], ...]``
(events_total: for streamed requests, how many events were published before this reply; run:
a replay's token, see Event), where kind is
    RESULTS  body is a list of ``count`` results
    BATCHED  body is an array/tensor, or a dict of them, whose first axis has ``count`` rows
    ERROR    body is [remote_type, message, traceback, error_kind] for all ``count`` items
    STEPS    like RESULTS, each result being the list of an item's generator steps

Event (published on ``P:events:C``): codec tag + encoding of ``[request_id, seq, *body]`` where
body is ``["h", hook, payload, start, size]`` (start/size: the caller's items in the batch) or
``["o", RESULTS, values, offset, count]`` (a generator step for items offset:offset+count).
A replay (a request run again after its worker died or stalled) starts with ``["r", run]``, run
an int > 0 of its own, and appends run to each of its bodies; the caller's stream follows one
run at a time (client/events.py).
The events one step or batch makes for one client go in one message: codec tag + encoding of
the list of them, ``[[request_id, seq, *body], ...]`` (clients tell the two forms apart by
the first element: an int, or a list). Clients older than that form drop such messages (the
answers still carry every result): upgrade clients before workers.
"""

from __future__ import annotations

from typing import Final

WIRE_VERSION: Final = 1
# The fields of a request stream entry: one request (h, p, a) or a pack of them (a, k).
ENTRY_FIELDS: Final = ("h", "p", "a", "k")

# Header field positions.
H_VERSION, H_ID, H_COUNT, H_REPLY_TO, H_DEADLINE, H_CODEC, H_EVENTS, H_PRIORITY, H_FIELDS = range(9)

# Requests one pack entry may hold: enqueue.lua closes a pack at this many (its
# MAX_PACK_REQUESTS), and a worker dead-letters whole a pack that holds more, unread, so that
# no entry costs a worker more than this many requests' work (dead letters included).
MAX_PACK_REQUESTS: Final = 1024
