"""Redis CPU per item of the single-item path, plain and as jobs, step by step (issue 26).

    python -m bench.job_cost [--rounds 40]

As ``bench.script_cost`` does for the plain path: on a private ``redis-server``, rounds of 512
one-item requests go through the enqueue (``enqueue.lua``, one call), the worker's reads
(``read.lua``) and its reply round trip (an inbox message, ``job.lua`` for jobs, ``ack.lua``),
and Redis's own CPU clock (``INFO cpu``) is read around each step. Once plain, once with each
request a job (``submit(..., keep=60)``: its header carries its keep, the enqueue writes its
record in its group, the reply its answer). Only this process talks to that server, so the
figures hold on a busy machine: they say what a job adds to Redis's share of
``bench.throughput``'s "keep / plain submit" ratio, per step (docs/benchmarks.md, "Jobs").
"""

from __future__ import annotations

import sys
from typing import Any

from bench.script_cost import Broker, N, on_private_redis, redis_cpu
from queueserve.wire.codec import get_codec
from queueserve.wire.job_record import inbox_group, job_writes
from queueserve.wire.keys import Keys, inbox_key
from queueserve.wire.reply import ReplyEncoder
from queueserve.wire.request import encode_request

KEEP_MS = 60_000
CLIENT_ID = "0123456789abcdef"


def steps(broker: Broker, rounds: int, jobs: bool) -> dict[str, float]:
    """Redis CPU µs per item of each step, over ``rounds`` rounds of N requests."""
    prefix = "qsjc" if jobs else "qsjp"  # one server, two layouts side by side
    keys = Keys(prefix, "noop")
    stream = keys.stream("default")
    broker.ensure_group(stream)
    codec = get_codec("msgpack")
    inbox = inbox_key(prefix, CLIENT_ID)
    encoder = ReplyEncoder(codec, bytes((codec.tag,)), 1 << 20, {})
    spent = {"enqueue": 0.0, "read": 0.0, "reply": 0.0}
    server: Any = broker.redis  # a plain server's client (bench.script_cost's Broker)
    rid = 0
    for _ in range(rounds):
        requests, records = [], []
        rows: dict[str, list[list[Any]]] = {}
        for i in range(N):
            rid += 1
            fields = {"job_keep": KEEP_MS} if jobs else None
            header, payload = encode_request(codec, rid, [i], inbox, None, "", 0, fields)
            requests.append(("default", 1, header, payload, 0))
            if jobs:
                group = inbox_group(inbox, rid)
                records.append((i, group, str(rid), KEEP_MS))
                rows.setdefault(group, []).append([rid, 0, 1, 0, [i]])
        # per record group, what the worker's replier hands job.lua: the group's rows in one
        # message, and its jobs as plain ones (a first run's answer that ends each)
        answers = []
        for group, group_rows in rows.items():
            messages = encoder.messages(group_rows)
            plain = [str(r[0]) for r in group_rows]
            answers.append((group, job_writes(messages, [], plain, len(messages[0]) / N)))
        c0 = redis_cpu(server)
        broker.enqueue(keys, requests, 0, jobs=records)
        c1 = redis_cpu(server)
        ids: list[bytes] = []
        while len(ids) < N:
            read = broker.read_ready(keys, "c", 256, 256, [])
            ids += [entry_id for _, entries in read.entries for entry_id, _ in entries]
        c2 = redis_cpu(server)
        # one inbox message for the N answers, as a worker sends one per (client, batch)
        reply = encoder.messages([[r, 0, 1, 0, [0]] for r in range(rid - N + 1, rid + 1)])
        broker.reply_and_ack(keys, {inbox: reply}, {stream: {1: ids}}, 60_000, jobs=answers)
        c3 = redis_cpu(server)
        server.delete(inbox)
        spent["enqueue"] += c1 - c0
        spent["read"] += c2 - c1
        spent["reply"] += c3 - c2
    return {k: v / (N * rounds) * 1e6 for k, v in spent.items()}


def main(argv: list[str] | None = None) -> int:
    plain, kept = on_private_redis(
        "python -m bench.job_cost",
        __doc__,
        argv,
        lambda broker, rounds: (
            steps(broker, rounds, jobs=False),
            steps(broker, rounds, jobs=True),
        ),
    )
    print("Redis CPU µs per item      plain   jobs  (keep=60)")
    for step in (*plain, "all"):
        a = sum(plain.values()) if step == "all" else plain[step]
        b = sum(kept.values()) if step == "all" else kept[step]
        print(f"  {step:<22} {a:7.2f} {b:6.2f}  ({b - a:+.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
