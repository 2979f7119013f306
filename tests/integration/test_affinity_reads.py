"""read.lua chooses as worker/pipeline/affinity.py's ``read_order`` does: the same table
(tests/unit/test_affinity.py), run on the ready set of a real Redis through the marks a
partition of a serving with load_key sends ('!<lean ms>', '@<key>', '^<key>', '*'), and '-<key>'
for work the worker holds."""

from __future__ import annotations

import contextlib

import pytest
import redis

from queueserve.broker.common import text
from queueserve.wire.codec import get_codec
from queueserve.wire.keys import Keys, inbox_key
from queueserve.wire.request import encode_request
from tests.support.broker import RedisBroker
from tests.unit.test_affinity import TABLE, Row


def marks_of(r: Row) -> list[str]:
    if r.lean_ms <= 0:
        return []
    return [
        f"!{r.lean_ms}",
        *(f"@{k}" for k in sorted(r.here)),
        *(f"^{k}" for k in sorted(r.elsewhere - r.here)),
        *(["*"] if r.may_load else []),
        *(["-other"] if r.holds_work else []),  # (some work of a key not ready here)
    ]


@pytest.mark.parametrize("r", TABLE, ids=[r.why for r in TABLE])
def test_read_lua_reads_first_the_key_the_table_says(
    r: Row, redis_url: str, redis_client: redis.Redis, prefix: str
) -> None:
    # Given the table's ready keys, each with one request, ranked by how long they waited
    keys = Keys(prefix, "affinity")
    inbox, codec = inbox_key(prefix, "c1"), get_codec("msgpack")
    with contextlib.closing(RedisBroker(redis_url)) as broker:
        for key, _, _ in r.ready:
            broker.ensure_group(keys.stream(key, 0))
            broker.enqueue(keys, [(key, 1, *encode_request(codec, 1, ["x"], inbox, None), 0)], 0)
        seconds, micros = redis_client.time()
        now = seconds * 1000 + micros // 1000
        for key, age, lead in r.ready:  # as enqueue.lua ranks: a lead 59,999.5 ms ahead
            rank = now - age - (59_999.5 if lead else 0)
            assert redis_client.zadd(keys.ready, {f"0{key}": rank}, xx=True) == 0
        # When a worker with room for one request reads, with the table's marks
        read = broker.read_ready(keys, "c", 1, 1, marks_of(r))
    # Then it read the key the table says (none: "-")
    read_keys = [keys.batch_key_of(text(s)) for s, _ in read.entries]
    assert read_keys == ([] if r.first == "-" else [r.first])
