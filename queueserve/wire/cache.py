"""The result cache: a serving with ``cache_ttl`` above 0 keeps the result of each item that
succeeded, and enqueue.lua answers a repeat of the item from it (docs/usage.md, "Result
cache"; docs/guarantees.md, "Cached results").

An item is cached as a request of its own (a client of a caching serving sends each item as
one), under a key named by its digest (wire/keys.py's layout), in the slot of the shard it went
to::

    P:{S}:cached:<digest hex>    string   <digest (16 bytes)><codec tag><codec's [kind, body]>

``digest`` is the BLAKE2b-128 of the serving's ``cache_version``, the request's batch key and
its payload (the codec's encoding of ``[item]``): another model version, another batch key
(another model behind the serving, another tenant's lane) or other bytes are other entries.
The worker computes it from the entry it ran, never from what a client claims, and the value
starts with it: enqueue.lua answers from a value only when its first 16 bytes are the digest it
looked up (a value copied under another item's key is a miss, never that item's answer). The
rest is one reply row's kind and body, encoded as the worker's replies are, so the client
decodes it as it decodes a reply (with a codec it accepts, or not at all).

Only results are cached (a row of kind RESULTS or BATCHED), never errors, and never a
generator batch function's steps (kind STEPS: a stream, answered in parts); a value over the
serving's ``cache_max_bytes`` is not written (counted as ``too_big``). Each entry lives
``cache_ttl``; nothing else bounds the total but the answers per ``cache_ttl``: the total is
at most (answers in ``cache_ttl``) x ``cache_max_bytes`` (docs/operations.md: what a
``maxmemory`` policy would evict besides cache entries).

``P:{S}:cachestats`` (hash) counts, per shard: ``hits`` and ``misses`` (enqueue.lua, per
cached request looked up), ``stored``, ``bytes`` (values written, and their sizes) and
``too_big`` (results over ``cache_max_bytes``, not written) by the workers; it lives
STATS_TTL_MS past the last count. Anyone may write it: readers take decimal counts only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Final

import msgpack

from queueserve.results import unbatch
from queueserve.wire.codec import Codec, codec_for_tag
from queueserve.wire.kinds import BATCHED, RESULTS

DIGEST_BYTES: Final = 16
HIT: Final = b"*"  # enqueue.lua's answer of a cached request found: HIT + the value's tail
MAX_VERSION_BYTES: Final = 200
STATS_TTL_MS: Final = 7 * 86400 * 1000  # the stats live a week past the last count
STATS: Final = ("hits", "misses", "stored", "bytes", "too_big")
# The kinds of a reply row that are a result (an error, a drop or an event is never cached)
CACHED_KINDS: Final = frozenset((RESULTS, BATCHED))


def check_version(version: object) -> str:
    """``version`` if it can be a cache_version (a str of at most MAX_VERSION_BYTES bytes of
    UTF-8, printable), else ValueError."""
    if (
        type(version) is str
        and version.isprintable()
        and len(version.encode()) <= MAX_VERSION_BYTES
    ):
        return version
    raise ValueError(
        f"cache_version must be a str of at most {MAX_VERSION_BYTES} bytes of printable text "
        f"(a model's name and revision), got {version!r:.80}"
    )


def digest(version: str, batch_key: str, payload: bytes) -> bytes:
    """The digest an item is cached under: its serving's cache_version, its request's batch
    key and payload (the encoding of ``[item]``)."""
    h = hashlib.blake2b(version.encode(), digest_size=DIGEST_BYTES)
    h.update(b"\0")
    h.update(batch_key.encode())
    h.update(b"\0")
    h.update(payload)
    return h.digest()


def shard_of(item_digest: bytes, shards: int) -> int:
    """The shard a cached request goes to: its item's, wherever it is sent from, so a repeat
    looks where the first one's result was written."""
    return int.from_bytes(item_digest[:4], "big") % shards


def lookup_spec(requests: list[tuple[int, bytes]]) -> bytes:
    """enqueue.lua's last argument for cached requests: msgpack of [request number (1 = the
    first), digest, ...], the digests as msgpack str (Redis's cmsgpack reads no bin type)."""
    packed: bytes = msgpack.packb([v for pair in requests for v in pair], use_bin_type=False)
    return packed


def value(item_digest: bytes, codec: Codec, kind: int, body: Any) -> bytes:
    """An entry's value: the digest it answers, the codec's tag, and the codec's encoding of
    the result's reply row ``[kind, body]``."""
    return item_digest + bytes((codec.tag,)) + codec.dumps([kind, body])


def answer(tail: bytes, accepted: set[int]) -> tuple[int, list[Any]]:
    """(kind, the one result) of enqueue.lua's answer of a cached request (the value after
    its digest: the codec's tag and the encoding of [kind, body]); ValueError saying what is
    wrong with it."""
    if not tail or tail[0] not in accepted:
        raise ValueError("its codec is none this client sent requests with")
    try:
        row = codec_for_tag(tail[0]).loads(memoryview(tail)[1:])
        if not isinstance(row, list) or len(row) != 2 or row[0] not in CACHED_KINDS:
            raise ValueError("it is no [kind, body] of a result")
        values = unbatch(row[0], row[1])
    except Exception as e:
        raise ValueError(f"it does not decode as a result: {e}") from None
    if len(values) != 1:
        raise ValueError(f"it holds {len(values)} results, not one")
    return row[0], values


def bad_value_message(serving: str, record_key: str, why: str) -> str:
    return (
        f"the cached result of this item of serving {serving!r} ({record_key!r:.120}) is not "
        f"one a worker writes ({why}): someone else wrote it; delete that key (DEL) and send "
        "the item again"
    )


def stats(raw: Mapping[Any, Any]) -> dict[str, int]:
    """The counts of a ``cachestats`` hash as read (bytes or str): each of STATS, 0 unless
    it holds a decimal count (anyone may write the hash)."""
    out = dict.fromkeys(STATS, 0)
    for name, count in raw.items():
        field = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        text = count.decode(errors="replace") if isinstance(count, bytes) else str(count)
        if field in out and text.isdigit() and len(text) <= 18:
            out[field] = int(text)
    return out
