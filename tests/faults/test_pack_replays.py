"""The requests of a pack reclaimed from a dead worker run again as replays (split.lua marks
the entries it makes of it with 'r'): a streamed one restarts its caller's stream
(docs/streaming.md, Replays), as a lone reclaimed request does
(tests/faults/test_step_faults.py); its pack's run is not counted against it, as its
batch-mates did not die of it. Before, the split entries
looked new, and a sampling serving's caller got two runs spliced into one stream."""

from __future__ import annotations

import msgpack
import redis

import queueserve as qs
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import GROUP, Keys, events_channel, inbox_key
from queueserve.wire.kinds import RESULTS
from queueserve.wire.request import encode_request
from queueserve.worker.middleware import Middleware
from queueserve.worker.pipeline.batch_context import event_rows
from queueserve.worker.pipeline.intake import Entry, Intake
from tests.support.broker import RedisBroker

MSGPACK = get_codec("msgpack")


def test_the_requests_of_a_reclaimed_pack_run_again_as_replays(
    redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given a pack of two streamed requests that a worker read and died holding
    keys = Keys(prefix, "sampled")
    stream = keys.stream("default")
    inbox, events = inbox_key(prefix, "c1"), events_channel(prefix, "c1")
    members = []
    for rid in (1, 2):
        header, payload = encode_request(MSGPACK, rid, [{"n": 60}], inbox, None, events=events)
        members.append([header, payload, b"1"])
    redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    pack_id = redis_client.xadd(
        stream, {"a": b"2", "k": msgpack.packb(members, use_bin_type=False)}
    )
    redis_client.xreadgroup(GROUP, "dead", {stream: ">"})
    # When the worker that reclaims it splits it
    broker = RedisBroker(redis_url)
    try:
        assert broker.split_pack(keys, stream, pack_id) == 2
    finally:
        broker.close()
    fresh = redis_client.xreadgroup(GROUP, "alive", {stream: ">"})[0][1]
    serving = qs.Serving(lambda xs: xs, name="sampled", batch_size=8).streaming()
    intake = Intake(serving, MSGPACK, keys, None, "alive", Middleware())  # type: ignore[arg-type]
    decided = intake.ingest([Entry(stream, entry_id, fields) for entry_id, fields in fresh])
    # Then each request is a replay: its first event is a restart marker for its caller
    requests = [piece.request for _, piece in decided.slices]
    assert [r.rid for r in requests] == [1, 2]
    assert all(r.replay and not r.redelivered for r in requests)  # not charged with its death
    for r in requests:
        first = event_rows(r, ["o", RESULTS, ["x"], 0, 1])[0]
        assert first[4][0] == "r", first  # a restart marker, then the run's own events
