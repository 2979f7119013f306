"""`queueserve dead-letter replay` takes nothing in a record on trust (docs/guarantees.md,
"Dead-letter replay"): a record is written by whoever can write to Redis, and replaying it
raises the admission counter, writes to the stream it names and sends its caller an answer.
Every field is checked first; a junk record is reported, skipped and kept, and `--all` goes on
past it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import msgpack
import redis

import queueserve as qs
from queueserve.wire.keys import Keys
from tests.support.fault_app import RawInbox, header, worker_env
from tests.support.helpers import REPO, stream_key, wait_until

StartWorker = Callable[..., qs.Worker]


def replay(*args: str, url: str, prefix: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "queueserve",
            "dead-letter",
            "replay",
            *args,
            "--redis-url",
            url,
            "--prefix",
            prefix,
        ],
        cwd=REPO,
        env=worker_env(url, prefix),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def dead_letter(r: redis.Redis, keys: Keys, stream: str, fields: dict[str, bytes]) -> str:
    """A record as a worker writes one (ops/deadletter.py), its request's fields given."""
    record = {
        "stream": stream,
        "entry_id": "1-0",
        "reason": "forged",
        "deliveries": 1,
        "at_ms": 0,
        **{f"field:{k}": v for k, v in fields.items()},
    }
    return str(r.xadd(keys.dead, record).decode())


def request(rid: int, n: int, reply_to: str, items: list[str]) -> dict[str, bytes]:
    return {"h": header(rid, n, reply_to), "p": msgpack.packb(items)}


def test_replay_refuses_forged_records_keeps_them_and_replays_the_rest(
    start_worker: StartWorker,
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a running serving with an admission limit
    start_worker(
        qs.Serving(
            lambda xs: [f"r:{x}" for x in xs],
            name="replayed",
            batch_size=8,
            batch_timeout=0,
            max_queue=100,
        )
    )
    keys = Keys(prefix, "replayed")
    wait_until(lambda: redis_client.hget(keys.meta, "max_queue"), "the serving declared")
    stream = stream_key(prefix, "replayed")
    inbox = RawInbox(redis_client, prefix)
    meta_before = redis_client.hgetall(keys.meta)

    # and dead letters: forged ones between two genuine ones
    first = dead_letter(redis_client, keys, stream, request(1, 1, inbox.key, ["a"]))
    junk = [
        # 10**12 items, a reply address that is not an inbox
        dead_letter(redis_client, keys, stream, request(2, 10**12, "elsewhere", ["x"])),
        # 10**12 items to a real inbox, with a payload of one
        dead_letter(redis_client, keys, stream, request(3, 10**12, inbox.key, ["x"])),
        # a count its payload disagrees with
        dead_letter(redis_client, keys, stream, request(4, 3, inbox.key, ["wxyz"])),
        # other keys of the serving's tag, and a stream of another serving
        dead_letter(redis_client, keys, keys.wake, request(5, 1, inbox.key, ["x"])),
        dead_letter(redis_client, keys, keys.meta, request(6, 1, inbox.key, ["x"])),
        dead_letter(
            redis_client, keys, stream_key(prefix, "other"), request(7, 1, inbox.key, ["x"])
        ),
        # a priority its stream does not have
        dead_letter(redis_client, keys, keys.stream("default", 3), request(8, 1, inbox.key, ["x"])),
        # no header at all, and a pack whose request has a bad reply address
        dead_letter(redis_client, keys, stream, {"p": msgpack.packb(["x"])}),
        dead_letter(
            redis_client,
            keys,
            stream,
            {
                "a": b"1",
                "k": msgpack.packb([[header(9, 1, "elsewhere"), msgpack.packb(["x"]), b"1"]]),
            },
        ),
    ]
    redis_client.xadd(keys.dead, {"stream": b"\xff\xfe", "deliveries": "x", "at_ms": "\u00b2"})
    last = dead_letter(redis_client, keys, stream, request(10, 1, inbox.key, ["b"]))

    # When every record is replayed
    done = replay("replayed", "--all", url=redis_url, prefix=prefix)

    # Then the genuine ones are replayed and answered, past the junk
    assert done.returncode == 1, done.stderr
    replayed = [line.split()[0] for line in done.stdout.splitlines()]
    assert replayed == [first, last], done.stdout
    wait_until(lambda: inbox.answered([1, 10]), "the replayed requests answered")
    assert [inbox.slices[rid][0][3] for rid in (1, 10)] == [["r:a"], ["r:b"]]
    # and each junk record is reported, saying why, and kept
    refused = done.stderr.splitlines()
    assert len(refused) == len(junk) + 1, done.stderr
    for dead_id, why in zip(
        junk,
        [
            "reply address 'elsewhere' is not an inbox",
            "claims 1000000000000 items, more than its payload of 3 bytes",
            "claims 3 items, its payload holds 1 items",
            "is not a request stream",
            "is not a request stream",
            "is not a request stream",
            "header says priority 0, its stream priority 3",
            "no request header",
            "reply address 'elsewhere' is not an inbox",
        ],
        strict=True,
    ):
        line = next(x for x in refused if f"dead letter {dead_id} " in x)
        assert why in line and "can only be dropped" in line, line
    kept = [i.decode() for i, _ in redis_client.xrange(keys.dead)]
    assert kept[: len(junk)] == junk and len(kept) == len(junk) + 1
    # and nothing was written anywhere a record named, nor counted
    wait_until(lambda: redis_client.get(keys.queued) == b"0", "admitted items released")
    assert redis_client.hgetall(keys.meta) == meta_before
    assert all(b"h" not in fields for _, fields in redis_client.xrange(keys.wake))
    assert not redis_client.exists(stream_key(prefix, "other"), keys.stream("default", 3))
    assert inbox.answered([1, 10]) and set(inbox.slices) == {1, 10}
    # and clients are admitted as before
    with qs.Client(redis_url, prefix=prefix) as client:
        assert client.dispatch("replayed", "c") == "r:c"


def test_replaying_one_junk_record_by_id_says_why_and_keeps_it(
    redis_client: redis.Redis,
    redis_url: str,
    prefix: str,
) -> None:
    # Given a serving some worker declared, and a forged record of it
    keys = Keys(prefix, "declared")
    redis_client.hset(keys.meta, "max_queue", 10)
    junk = dead_letter(
        redis_client, keys, stream_key(prefix, "declared"), request(1, 10**12, "elsewhere", ["x"])
    )

    # When it is replayed by its id
    done = replay("declared", junk, url=redis_url, prefix=prefix)

    # Then it is refused, saying why and what to do, kept, and nothing is counted
    assert done.returncode == 1 and done.stdout == ""
    assert "reply address 'elsewhere' is not an inbox" in done.stderr
    assert f"queueserve dead-letter drop declared {junk}" in done.stderr
    assert [i.decode() for i, _ in redis_client.xrange(keys.dead)] == [junk]
    assert redis_client.get(keys.queued) is None
    assert not redis_client.exists(stream_key(prefix, "declared"))
