"""wire/keys.py's readers of key names: the serving a key belongs to, the SCAN pattern of a kind
of key, and a client's inbox taken apart, each against the names ``Keys`` and the builders make
(the listings of ops/ read servings from scanned keys with them: broker/admin.py)."""

from __future__ import annotations

from fnmatch import fnmatchcase

from queueserve.wire.keys import (
    Keys,
    events_channel,
    inbox_key,
    is_events_channel,
    is_inbox,
    serving_of,
    split_inbox,
    tagged_pattern,
)


def test_a_key_of_shard_0_names_its_serving_and_another_shards_key_none() -> None:
    shards = Keys("qs", "embed.v2-x").sharded(4)
    assert serving_of(shards[0].meta) == "embed.v2-x"
    assert serving_of(shards[0].queued) == "embed.v2-x"
    assert [serving_of(keys.meta) for keys in shards[1:]] == [None, None, None]


def test_the_pattern_of_a_kind_matches_that_kind_of_every_shard_and_no_other() -> None:
    shards = Keys("qs", "s").sharded(3)
    pattern = tagged_pattern("qs", "meta")
    assert all(fnmatchcase(keys.meta, pattern) for keys in shards)
    assert not any(fnmatchcase(keys.queued, pattern) for keys in shards)
    assert not fnmatchcase(Keys("other", "s").meta, pattern)


def test_an_inbox_is_told_from_other_keys_and_taken_apart() -> None:
    inbox = inbox_key("app:qs", "0123abcd")
    assert is_inbox("app:qs", inbox)
    assert split_inbox(inbox) == ("app:qs", "0123abcd")
    assert not is_inbox("app:qs", inbox_key("app:qs", "a:b"))
    assert not is_inbox("qs", inbox)
    assert not is_inbox("app:qs", Keys("app:qs", "s").meta)
    assert is_events_channel("app:qs", events_channel("app:qs", "c1"))
    assert not is_events_channel("app:qs", inbox)
