"""Batch-key rules that every door applies, not only the serving's own Python callers.

A serving's ``batch_key`` may be any function of an item, but a function runs only where the
serving object is: a client that names the serving (the gateway, a producer in another
language) cannot call it, and sent every text of a call under one key. A rule is a batch-key
function with a text form: the serving's workers declare it in its meta hash
(``batch_key_rule``, docs/protocol.md), and a client that knows the serving by name groups items
by it as the serving's own callers do (client/targets.py). The text is read from Redis, which
strangers may write: ``LengthBuckets.parse`` takes only what ``LengthBuckets`` would accept.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

META_FIELD: Final = "batch_key_rule"
KIND: Final = "length"
MAX_UNITS: Final = 1 << 20  # the longest item a bucket may be sized for
MAX_CHARS_PER_UNIT: Final = 64
MAX_EXTRA: Final = 1024
INVALID: Final = "invalid"  # the key of an item that has no length: its batch answers its error
_PREFIX = re.compile(r"[A-Za-z0-9_.-]{0,16}")
_FIELD = re.compile(r"([a-z_]{1,20})=([A-Za-z0-9_.-]{0,16})")


@dataclass(frozen=True, slots=True)
class LengthBuckets:
    """The batch key of an item by its length, in power-of-two buckets: texts of similar
    length share batches, so little of a batch is padding (a transformer's batch costs as its
    longest text does).

    A ``str`` counts ``len(text) // chars_per_unit + extra`` units (a cheap token estimate:
    about 4 characters a token for English, plus a model's two special tokens); a list, tuple
    or one-dimensional array (token ids) counts its length. The count, held within
    [``smallest``, ``largest``], is rounded up to a power of two: the key is
    ``f"{prefix}{bucket}"`` (``t16``, ``t32``... ``t256`` by default). Anything else gets the key
    ``"invalid"``, where the batch function answers it with its per-item error.

    >>> embed = qs.Serving(encode, name="embed", batch_key=qs.LengthBuckets(largest=512))
    """

    smallest: int = 16
    largest: int = 256
    chars_per_unit: int = 4
    extra: int = 2
    prefix: str = "t"

    def __post_init__(self) -> None:
        for name, low, high in (
            ("smallest", 1, MAX_UNITS),
            ("largest", 1, MAX_UNITS),
            ("chars_per_unit", 1, MAX_CHARS_PER_UNIT),
            ("extra", 0, MAX_EXTRA),
        ):
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ValueError(
                    f"LengthBuckets: {name} must be an int in [{low}, {high}], got {value!r:.40}"
                )
        if self.smallest > self.largest:
            raise ValueError(
                f"LengthBuckets: smallest={self.smallest} is more than largest={self.largest}"
            )
        if not (isinstance(self.prefix, str) and _PREFIX.fullmatch(self.prefix)):
            raise ValueError(
                "LengthBuckets: prefix must be at most 16 letters, digits, '_', '.' or '-', "
                f"got {self.prefix!r:.40}"
            )

    def __call__(self, item: Any) -> str:
        if isinstance(item, str):
            units = len(item) // self.chars_per_unit + self.extra
        elif isinstance(item, list | tuple) or getattr(item, "ndim", None) == 1:
            units = len(item)
        else:
            return INVALID
        units = min(max(units, self.smallest), self.largest)
        return f"{self.prefix}{1 << (units - 1).bit_length()}"

    def text(self) -> str:
        """The rule as workers declare it (``parse`` reads it back)."""
        return (
            f"{KIND} smallest={self.smallest} largest={self.largest} "
            f"chars_per_unit={self.chars_per_unit} extra={self.extra} prefix={self.prefix}"
        )

    @classmethod
    def parse(cls, text: str) -> LengthBuckets:
        """The rule ``text`` declares; ValueError saying what was wrong."""
        kind, *pairs = text.split(" ")
        if kind != KIND:
            raise ValueError(f"batch_key_rule: {kind!r:.40} is not a rule (known: {KIND})")
        given: dict[str, Any] = {}
        for pair in pairs:
            m = _FIELD.fullmatch(pair)
            if m is None or m.group(1) not in cls.__dataclass_fields__ or m.group(1) in given:
                raise ValueError(f"batch_key_rule: {pair!r:.40} is not one name=value of a rule")
            name, value = m.groups()
            if name != "prefix":
                if not value.isdigit() or len(value) > 7:
                    raise ValueError(f"batch_key_rule: {name} must be an int, got {value!r}")
                given[name] = int(value)
            else:
                given[name] = value
        return cls(**given)
