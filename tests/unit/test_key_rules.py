"""``qs.LengthBuckets`` (wire/key_rules.py): the key of an item by its length, the text form
workers declare, and what a client takes of a text read from Redis."""

from __future__ import annotations

import numpy as np
import pytest

import queueserve as qs
from queueserve.wire.key_rules import INVALID, LengthBuckets


def reference(units: int, smallest: int, largest: int) -> int:
    """The bucket by its definition: the least power of two >= the count held in range."""
    n = min(max(units, smallest), largest)
    bucket = 1
    while bucket < n:
        bucket *= 2
    return bucket


@pytest.mark.parametrize("smallest,largest", [(16, 256), (1, 1), (3, 100), (5, 5)])
def test_keys_are_power_of_two_buckets_of_the_estimated_length(smallest: int, largest: int) -> None:
    rule = LengthBuckets(smallest=smallest, largest=largest, chars_per_unit=3, extra=1, prefix="b")
    for chars in range(0, 1200, 7):
        want = reference(chars // 3 + 1, smallest, largest)
        assert rule("x" * chars) == f"b{want}", chars
    for n in (0, 1, 9, 300):  # token ids: their number, no estimate
        want = f"b{reference(n, smallest, largest)}"
        assert rule(list(range(n))) == rule(tuple(range(n))) == rule(np.zeros(n)) == want
    for other in (42, None, {"text": "x"}, np.zeros((2, 2)), b"bytes"):
        assert rule(other) == INVALID


def test_the_declared_text_reads_back_as_the_same_rule() -> None:
    for rule in (
        qs.LengthBuckets(),
        qs.LengthBuckets(smallest=1, largest=1 << 20, chars_per_unit=64, extra=1024, prefix=""),
        qs.LengthBuckets(prefix="A-z_.9"),
    ):
        assert LengthBuckets.parse(rule.text()) == rule
    assert LengthBuckets.parse("length") == LengthBuckets()  # every field has its default
    assert LengthBuckets.parse("length largest=512") == LengthBuckets(largest=512)


@pytest.mark.parametrize(
    "text,says",
    [
        ("", "is not a rule"),
        ("lengths smallest=1", "is not a rule"),
        ("length smallest=0", "smallest must be an int in [1, 1048576]"),
        ("length largest=99999999999", "largest must be an int"),
        ("length largest=2097152", "largest must be an int in [1, 1048576]"),
        ("length smallest=9 largest=8", "is more than largest"),
        ("length chars_per_unit=0", "chars_per_unit must be"),
        ("length extra=-1", "extra must be an int"),
        ("length extra=1.5", "extra must be an int"),
        ("length prefix=a/b", "is not one name=value"),
        ("length prefix=12345678901234567", "is not one name=value"),
        ("length smallest=2 smallest=3", "is not one name=value"),
        ("length colour=red", "is not one name=value"),
        ("length  smallest=2", "is not one name=value"),
        ("length smallest=\u0663", "is not one name=value"),
    ],
)
def test_a_text_no_rule_would_have_is_refused_saying_why(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=r"^(batch_key_rule|LengthBuckets): ") as e:
        LengthBuckets.parse(text)
    assert says in str(e.value)


def test_a_rule_in_code_is_checked_as_one_read_from_redis() -> None:
    with pytest.raises(ValueError, match="prefix must be at most 16"):
        qs.LengthBuckets(prefix="has space")
    with pytest.raises(ValueError, match="smallest must be an int"):
        qs.LengthBuckets(smallest=True)  # a bool is no count
    serving = qs.Serving(len, name="lens", batch_key=qs.LengthBuckets(largest=64))
    assert serving.options()["batch_key_rule"] == qs.LengthBuckets(largest=64).text()
    assert qs.Serving(len, name="plain").options()["batch_key_rule"] == ""
