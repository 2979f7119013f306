"""Nothing read from Redis is trusted (docs/guarantees.md, "Hostile entries"): a forged reply
address, admission count or array header, a result too large for Redis or one the codec cannot
encode — each fails the entry or the item it belongs to, never the worker, and touches no key
outside this prefix's layout.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, ClassVar

import msgpack
import numpy as np
import pytest
import redis

import queueserve as qs
from queueserve.wire.codec import MsgpackCodec
from queueserve.wire.kinds import BATCHED, ERR_REMOTE, ERROR, EVENT, RESULTS
from queueserve.worker.pipeline.batching import Request
from queueserve.worker.pipeline.replies import compose
from tests.support.fault_app import RawInbox, header
from tests.support.helpers import stream_key, wait_until
from tests.support.redis_server import RedisServer
from tests.support.stream_app import Hooks

StartWorker = Callable[..., qs.Worker]
WAIT_S = 60.0
CODEC = MsgpackCodec()


def pack(value: Any) -> bytes:
    return bytes(msgpack.packb(value))


def echo(name: str, **options: Any) -> qs.Serving:
    return qs.Serving(lambda xs: list(xs), name=name, batch_size=8, batch_timeout=0, **options)


# --- reply addresses ------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["stream", "app_key", "other_prefix_inbox", "hash_tag"])
def test_a_forged_reply_address_is_dead_lettered_and_its_key_is_never_touched(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    target: str,
) -> None:
    # Given a worker, queued requests, and keys that are not inboxes of this prefix
    serving = echo("addr")
    start_worker(serving)
    stream = stream_key(prefix, "addr")
    app_key = f"{prefix}-app:settings"
    redis_client.set(app_key, "precious")
    reply_to = {
        "stream": stream,
        "app_key": app_key,
        "other_prefix_inbox": f"{prefix}x:inbox:abc",
        "hash_tag": f"{prefix}:inbox:{{addr}}:in:default",
    }[target]
    assert client.dispatch(serving, "before", timeout=WAIT_S) == "before"

    # When entries name that key as their reply address
    for rid in range(5):
        redis_client.xadd(stream, {"h": header(rid, 1, reply_to), "p": pack(["x"])})

    # Then each is dead-lettered with the reason, and the named key keeps its type, value and
    # lack of a TTL
    dead = f"{prefix}:{{addr}}:dead"
    wait_until(lambda: redis_client.xlen(dead) == 5, "the dead letters")
    for _, fields in redis_client.xrange(dead):
        assert b"is not an inbox of prefix" in fields[b"reason"]
    assert redis_client.get(app_key) == b"precious" and redis_client.pttl(app_key) == -1
    assert redis_client.pttl(stream) == -1
    # and the worker serves on
    assert client.dispatch(serving, "after", timeout=WAIT_S) == "after"
    redis_client.delete(app_key)


def test_a_forged_events_channel_gets_bad_request_and_nothing_is_published(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given a worker of a serving that streams hooks, and a subscriber of the application's
    # channel
    start_worker(Hooks(name="chan", batch_size=8, batch_timeout=0))
    inbox = RawInbox(redis_client, prefix)
    channel = f"{prefix}-app-channel"
    tap = redis_client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
    tap.subscribe(channel)
    wait_until(lambda: redis_client.pubsub_numsub(channel)[0][1] == 1, "the subscription")
    try:
        # When an entry names that channel as its events channel
        fields = [1, 3, 1, inbox.key, 0, "msgpack", channel]
        redis_client.xadd(stream_key(prefix, "chan"), {"h": pack(fields), "p": pack(["x"])})

        # Then its inbox gets BadRequest
        wait_until(lambda: inbox.answered([3]), "the answer")
        assert inbox.error_kind(3) == "bad_request"
        assert "is not a client channel of prefix" in inbox.slices[3][0][3][1]
        # and nothing was published on the channel before the answer (a worker publishes a
        # request's events before its reply, in one pipeline), which a marker of ours ends
        redis_client.publish(channel, "marker")
        received: list[bytes] = []

        def marker_came() -> bool:
            message = tap.get_message(timeout=0.1)
            if message is not None:
                received.append(message["data"])
            return b"marker" in received

        wait_until(marker_came, "our marker")
        assert received == [b"marker"]
    finally:
        tap.close()
    assert client.dispatch("chan", "ok", timeout=WAIT_S) == "r:ok"


def test_an_inbox_of_the_wrong_type_drops_that_reply_and_the_rest_are_answered(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given an inbox key someone made a string
    start_worker(echo("wrongtype"))
    bad_inbox = f"{prefix}:inbox:vandalised"
    redis_client.set(bad_inbox, "not a list")

    # When a request replying there is served alongside good ones
    redis_client.xadd(
        stream_key(prefix, "wrongtype"), {"h": header(1, 1, bad_inbox), "p": pack(["x"])}
    )

    # Then later requests are still answered, and that entry was acked
    for i in range(20):
        assert client.dispatch("wrongtype", i, timeout=WAIT_S) == i
    wait_until(lambda: redis_client.xlen(stream_key(prefix, "wrongtype")) == 0, "every ack")
    assert redis_client.get(bad_inbox) == b"not a list"


# --- admission counts -----------------------------------------------------------------------
@pytest.mark.parametrize("forged", [b"100000000000000000000", b"1000000000", b"-1", b"x", b"3"])
def test_a_forged_admission_count_cannot_break_or_drain_the_counter(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    forged: bytes,
) -> None:
    # Given a serving with max_queue whose counter holds a legitimate backlog, recording what
    # it runs
    ran: list[Any] = []
    start_worker(
        qs.Serving(
            lambda xs: ran.extend(xs) or list(xs),
            name="counted",
            batch_size=8,
            batch_timeout=0,
            max_queue=1000,
        )
    )
    queued = f"{prefix}:{{counted}}:queued"
    redis_client.set(queued, 40)  # as if 40 admitted items were waiting elsewhere
    inbox = RawInbox(redis_client, prefix)

    # When an entry with 2 items claims to have been admitted with ``forged`` items
    stream = stream_key(prefix, "counted")
    redis_client.xadd(stream, {"h": header(9, 2, inbox.key), "p": pack(["a", "b"]), "a": forged})

    # Then its caller gets BadRequest naming the field, and its items never run
    wait_until(lambda: inbox.answered([9]), "the answer")
    assert inbox.error_kind(9) == "bad_request"
    assert "its admission count ('a') is not an integer" in inbox.slices[9][0][3][1]
    # and the worker serves on; once every entry is acked (ack.lua releases and deletes in
    # one call) the counter holds exactly the backlog: the forged entry released nothing (a
    # worker that clamped the count to the entry's 2 items would leave 38)
    assert client.dispatch("counted", "next", timeout=WAIT_S) == "next"
    wait_until(lambda: redis_client.xlen(stream) == 0, "every entry acked")
    assert int(redis_client.get(queued) or 0) == 40
    assert ran == ["next"]


# --- array headers --------------------------------------------------------------------------
def ext(code: int, dtype: str, shape: list[int], body: bytes) -> bytes:
    return pack(msgpack.ExtType(code, pack([dtype, shape, body])))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (ext(2, "float32", [1 << 30], b""), "needs 4294967296 bytes, the message carries 0"),
        (ext(1, "<f8", [1 << 20, 1 << 20], b"\x00" * 8), "the message carries 8"),
        (ext(1, "<f8", [-1], b""), "malformed numpy array header"),
        (ext(1, "|O", [1], b"\x00" * 8), "cannot be decoded"),
        (ext(2, "no_such_dtype", [1], b"\x00"), "unknown dtype"),
        (ext(1, "<i4", [2, 2], b"\x00" * 12), "needs 16 bytes"),
    ],
    ids=[
        "empty-body-4GiB",
        "8-bytes-8TiB",
        "negative-dim",
        "object-dtype",
        "unknown-dtype",
        "short-body",
    ],
)
def test_array_headers_must_match_their_bodies(payload: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CODEC.loads(payload)


def test_an_amplifying_tensor_header_gets_bad_request_not_a_huge_allocation(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    seen: list[Any] = []
    start_worker(
        qs.Serving(
            lambda xs: seen.extend(xs) or [0] * len(xs), name="amp", batch_size=8, batch_timeout=0
        )
    )
    inbox = RawInbox(redis_client, prefix)
    payload = pack([msgpack.ExtType(2, pack(["float32", [1 << 30], b""]))])
    redis_client.xadd(stream_key(prefix, "amp"), {"h": header(4, 1, inbox.key), "p": payload})

    wait_until(lambda: inbox.answered([4]), "the answer")
    assert inbox.error_kind(4) == "bad_request" and seen == []


# --- replies too large, or not encodable ----------------------------------------------------
def rows(*bodies: tuple[int, Any]) -> list[Any]:
    out = []
    for rid, (kind, body) in enumerate(bodies, start=1):
        count = len(body["v"]) if isinstance(body, dict) else len(body)
        request = Request(b"1-0", "s", rid, "qs:inbox:c", 0.0, count, "", False)
        request.remaining = count
        out.append((request, 0, count, kind, body))
    return out


def decoded(messages: list[bytes]) -> list[list[Any]]:
    return [row for m in messages for row in CODEC.loads(m[1:])]


def test_replies_are_cut_under_max_reply_bytes_and_an_oversize_item_fails_alone() -> None:
    big = b"x" * 3000
    out = compose(
        rows(
            (RESULTS, [big, big, big]),
            (RESULTS, [big, b"y" * 20_000]),
            (BATCHED, {"v": np.zeros((4, 200), np.float32)}),
        ),
        CODEC,
        8192,
    )
    messages = out.messages["qs:inbox:c"]
    assert len(messages) > 1 and all(len(m) <= 8192 for m in messages)
    got: dict[tuple[int, int], Any] = {}
    for rid, offset, count, kind, body in decoded(messages):
        for i in range(count):
            value = body if kind == ERROR else (body["v"][i] if kind == BATCHED else body[i])
            got[(rid, offset + i)] = (kind, value)
    assert [got[(1, i)] for i in range(3)] == [(RESULTS, big)] * 3
    assert got[(2, 0)] == (RESULTS, big)
    kind, error = got[(2, 1)]
    assert kind == ERROR and "over the serving's max_reply_bytes=8192" in error[1]
    assert all(got[(3, i)][0] == BATCHED for i in range(4))
    assert out.errors == {ERR_REMOTE: 1}


def test_an_unencodable_result_fails_its_item_alone() -> None:
    out = compose(rows((RESULTS, [1, object(), 3])), CODEC, 1 << 20)
    by_offset = {}
    for _, offset, count, kind, body in decoded(out.messages["qs:inbox:c"]):
        for i in range(count):
            by_offset[offset + i] = body if kind == ERROR else body[i]
    assert by_offset[0] == 1 and by_offset[2] == 3
    assert "cannot be encoded with codec 'msgpack'" in by_offset[1][1]


def test_events_go_one_message_per_client_and_alone_when_together_they_would_not_fit() -> None:
    def event(rid: int, channel: str, value: Any) -> Any:
        request = Request(b"1-0", "s", rid, "qs:inbox:c", 0.0, 1, channel, True)
        return (request, 0, 0, EVENT, ["o", RESULTS, [value], 0, 1])

    # One client's events of a step: one message, a list of them, in order; another client's
    # single event: alone, in the form of a single event
    out = compose(
        [event(1, "qs:events:a", "x"), event(2, "qs:events:b", "y"), event(3, "qs:events:a", "z")],
        CODEC,
        1 << 20,
    )
    assert [(channel, CODEC.loads(data[1:])) for channel, data in out.events] == [
        ("qs:events:a", [[1, 0, "o", RESULTS, ["x"], 0, 1], [3, 0, "o", RESULTS, ["z"], 0, 1]]),
        ("qs:events:b", [2, 0, "o", RESULTS, ["y"], 0, 1]),
    ]
    # Events that would pass max_reply_bytes together go one by one; one too large alone, or
    # that the codec cannot carry, is dropped, and the others still go
    big = "v" * 600
    out = compose(
        [
            event(1, "qs:events:a", big),
            event(2, "qs:events:a", big),
            event(3, "qs:events:a", "w" * 2000),
            event(4, "qs:events:a", object()),
        ],
        CODEC,
        1024,
    )
    assert [CODEC.loads(data[1:])[0] for _, data in out.events] == [1, 2]


def test_unencodable_results_reach_their_callers_as_errors_and_the_worker_serves_on(
    start_worker: StartWorker, client: qs.Client
) -> None:
    def answer(xs: list[str]) -> list[Any]:
        return [object() if x == "bad" else x.upper() for x in xs]

    start_worker(qs.Serving(answer, name="enc", batch_size=8, batch_timeout=0.05))
    tickets = [client.submit("enc", [x]) for x in ("a", "bad", "c", "bad", "e")]
    results = [t.result(WAIT_S, return_exceptions=True) for t in tickets]

    assert results[0] == ["A"] and results[2] == ["C"] and results[4] == ["E"]
    for failed in (results[1], results[3]):
        assert isinstance(failed[0], qs.RemoteError) and "cannot be encoded" in str(failed[0])
    assert client.dispatch("enc", "z", timeout=WAIT_S) == "Z"


@pytest.mark.timeout(120)
def test_replies_larger_than_redis_accepts_in_one_value_are_split_and_answered(
    redis_tmp_server: RedisServer,
    prefix: str,
) -> None:
    # Given a Redis that refuses values over 1 MiB (as a real one refuses 512 MiB), and a
    # serving whose results together exceed that in one batch for one client
    admin = redis.Redis.from_url(redis_tmp_server.url)
    admin.config_set("proto-max-bulk-len", 1024 * 1024)
    serving = qs.Serving(
        lambda xs: [b"r" * 300_000 for _ in xs],
        name="bulky",
        batch_size=8,
        batch_timeout=0.2,
        max_reply_bytes=512 * 1024,
    )
    worker = qs.Worker(
        [serving],
        redis_url=redis_tmp_server.url,
        prefix=prefix,
        handle_signals=False,
        shutdown_timeout=10.0,
    ).start()
    client = qs.Client(redis_tmp_server.url, prefix=prefix)
    try:
        # When six one-item requests share a batch (1.8 MB of replies for one inbox)
        tickets = [client.submit("bulky", [i]) for i in range(6)]

        # Then every caller gets its result
        assert [len(t.result(WAIT_S)[0]) for t in tickets] == [300_000] * 6
    finally:
        client.close()
        worker.stop(timeout=10.0)
        admin.close()


# --- all of it at once ----------------------------------------------------------------------
FORGED_PER_CLASS = 1000
VALID = 5000
BACKLOG = 100_000


def forged_entries(prefix: str, inbox: str) -> list[tuple[str, dict[str, bytes]]]:
    """FORGED_PER_CLASS entries of each class above: (class, fields)."""
    tensor = pack([msgpack.ExtType(2, pack(["float32", [1 << 30], b""]))])
    classes: dict[str, Callable[[int], dict[str, bytes]]] = {
        "reply to the stream": lambda rid: {
            "h": header(rid, 1, stream_key(prefix, "mixed")),
            "p": pack([rid]),
        },
        "reply to an app key": lambda rid: {
            "h": header(rid, 1, f"{prefix}-app:k"),
            "p": pack([rid]),
        },
        "foreign events channel": lambda rid: {
            "h": pack([1, rid, 1, inbox, 0, "msgpack", "app-channel"]),
            "p": pack([rid]),
        },
        "admission count 10**20": lambda rid: {
            "h": header(rid, 1, inbox),
            "p": pack([rid]),
            "a": b"100000000000000000000",
        },
        "admission count 10**9": lambda rid: {
            "h": header(rid, 1, inbox),
            "p": pack([rid]),
            "a": b"1000000000",
        },
        "4 GiB tensor header": lambda rid: {"h": header(rid, 1, inbox), "p": tensor},
        "unencodable result": lambda rid: {"h": header(rid, 1, inbox), "p": pack(["object"])},
    }
    out = []
    for i in range(FORGED_PER_CLASS):
        for n, (name, make) in enumerate(classes.items()):
            out.append((name, make(1_000_000 + i * len(classes) + n)))
    return out


@pytest.mark.timeout(300)
def test_forged_entries_of_every_class_mixed_into_valid_traffic_lose_nothing(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a worker counting every execution of every valid item
    executed: dict[int, int] = {}

    def run(xs: list[Any]) -> list[Any]:
        for x in xs:
            if isinstance(x, int):
                executed[x] = executed.get(x, 0) + 1
        return [object() if x == "object" else x for x in xs]

    worker = start_worker(
        qs.Serving(run, name="mixed", batch_size=64, batch_timeout=0.002, max_queue=1_000_000)
    )
    inbox = RawInbox(redis_client, prefix)
    stream = stream_key(prefix, "mixed")
    forged = forged_entries(prefix, inbox.key)
    # a backlog the forged counts must not drain (from zero, ack.lua's clamp would hide it)
    queued = f"{prefix}:{{mixed}}:queued"
    redis_client.set(queued, BACKLOG)
    per_valid = len(forged) // VALID + 1

    # When 7,000 forged entries (1,000 of each class) are mixed into 5,000 valid requests
    tickets = []
    for i in range(VALID):
        pipe = redis_client.pipeline(transaction=False)
        for _, fields in forged[i * per_valid : (i + 1) * per_valid]:
            pipe.xadd(stream, fields)  # type: ignore[arg-type]
        pipe.execute()
        tickets.append(client.submit("mixed", [i]))

    # Then every valid request is answered with its own result, none lost, none twice
    results = [t.result(120) for t in tickets]
    lost = sum(r != [i] for i, r in enumerate(results))
    duplicated = sum(n > 1 for n in executed.values())
    wait_until(lambda: redis_client.xlen(stream) == 0, "every entry acked", timeout=120)
    dead = redis_client.xlen(f"{prefix}:{{mixed}}:dead")
    inbox.drain()
    with capsys.disabled():
        print(
            f"\nforged entries mixed into valid traffic: valid sent {VALID}, answered "
            f"{VALID - lost}, lost {lost}, executed twice {duplicated}; forged "
            f"{len(forged)}: dead-lettered {dead}, answered with an error {len(inbox.slices)}"
        )
    assert lost == 0 and duplicated == 0
    # and every forged entry was either dead-lettered or answered, the stream is empty, the
    # admission counter is back at its backlog, and the worker's threads are all alive
    assert dead + len(inbox.slices) == len(forged)
    assert int(redis_client.get(queued) or 0) == BACKLOG
    assert worker._host is not None and worker._host.alive()


# --- codec choice belongs to the caller -----------------------------------------------------
class _Boom:
    """Unpickling this runs code: it records that it ran."""

    ran: ClassVar[list[str]] = []

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Boom.ran.append, ("unpickled",))


def pickled_serving(name: str) -> qs.Serving:
    return qs.Serving(
        lambda xs: [{"echo": x} for x in xs],
        name=name,
        batch_size=8,
        batch_timeout=0,
        codec="pickle",
    )


def test_a_client_naming_a_serving_never_takes_pickle_from_redis(
    start_worker: StartWorker,
    client: qs.Client,
    redis_client: redis.Redis,
    prefix: str,
    redis_url: str,
) -> None:
    # Given a serving whose workers declare codec pickle (or a peer who set it in its meta)
    serving = pickled_serving("pickled")
    start_worker(serving)
    meta = f"{prefix}:{{pickled}}:meta"
    wait_until(lambda: redis_client.hget(meta, "codec") == b"pickle", "the declaration")

    # When a client calls it by name, it is refused with what to do, and nothing is sent
    with pytest.raises(qs.BadRequest, match=r"codec 'pickle' in Redis.*Pass the qs.Serving"):
        client.dispatch("pickled", 1, timeout=WAIT_S)
    # and a pickle pushed into the inbox of a client that never chose pickle is never decoded:
    # it is read (the next answer, pushed after it, arrives) and dropped
    start_worker(echo("plain"))
    assert client.dispatch("plain", "first", timeout=WAIT_S) == "first"
    _Boom.ran.clear()
    inbox = f"{prefix}:inbox:{client.client_id}"
    redis_client.rpush(inbox, b"p" + pickle.dumps([[1, 0, 1, RESULTS, [_Boom()]]]))
    assert client.dispatch("plain", "second", timeout=WAIT_S) == "second"
    assert _Boom.ran == []

    # Then the serving object, or a client that says it trusts pickle, may use it
    assert client.dispatch(serving, 2, timeout=WAIT_S) == {"echo": 2}
    with qs.Client(redis_url, prefix=prefix, codec="pickle") as trusting:
        assert trusting.dispatch("pickled", 3, timeout=WAIT_S) == {"echo": 3}
