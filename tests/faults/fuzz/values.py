"""Hostile values, by family: what a stranger with write access to Redis might leave in a key.

Each family is a function of a seeded ``random.Random``, so a run is reproduced by its seed.
Writers take these bytes as they are (a field, a member, a message) or, where the layout holds
msgpack, put ``hostile_object`` values inside an otherwise well-formed structure.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import msgpack

HUGE_BYTES = 10 * 1024 * 1024  # a 10 MB field: Redis takes it, a reader must not choke on it
DEEP = 100_000  # msgpack nesting depth: far past any decoder's stack

# Numbers a parser may take for valid: NaN, infinities, overflows, negatives, a float where an
# int is meant, other bases. Small positive integers are left out on purpose: they are valid
# settings (max_queue=3 throttles callers by design), not hostile values.
NUMBERS = (
    b"nan",
    b"NaN",
    b"-nan",
    b"inf",
    b"-inf",
    b"Infinity",
    b"1e308",
    b"-1e308",
    b"1e19",
    b"-1",
    b"-0",
    b"0",
    b"10000000000000000000",
    b"18446744073709551616",
    b"-9223372036854775809",
    b"9" * 400,
    b"1.5",
    b"0x10",
    b"1_000",
    b"",
    b"  ",
    b"0.0000001",
)
SEPARATORS = (
    b"\n",
    b"a\nb",
    b"\r\n",
    b":",
    b"a:b:c",
    b"{",
    b"}",
    b"{x}",
    b"}{",
    b"#1",
    b"\x00",
    b"a\x00b",
    b"*",
    b"?",
    b"[",
    b"\\",
    b"%s%n",
    b"'",
    b'"',
    b"--",
    b"0-0",
    b"$",
    b"\t",
)


def non_utf8(rng: random.Random) -> bytes:
    fixed = (b"\xff", b"\xfe\xff", b"\x80abc", b"\xc3\x28", b"\xed\xa0\x80", b"a\xffb:c\n")
    if rng.random() < 0.5:
        return rng.choice(fixed)
    return bytes(rng.randrange(128, 256) for _ in range(rng.randrange(1, 64)))


def numbers(rng: random.Random) -> bytes:
    return rng.choice(NUMBERS)


def separators(rng: random.Random) -> bytes:
    a, b = rng.choice(SEPARATORS), rng.choice(SEPARATORS)
    return rng.choice((a, b"x" + a + b"y", a + b))


@functools.cache
def _deep(opener: bytes) -> bytes:
    return opener * DEEP + b"\xc0"


def nesting(rng: random.Random) -> bytes:
    """Msgpack nested far too deep: arrays, maps, or a header-shaped list around them."""
    kind = rng.randrange(3)
    if kind == 0:
        return _deep(b"\x91")  # [[[[...]]]]
    if kind == 1:
        return _deep(b"\x81\xc0")  # {nil: {nil: ...}}
    return b"\x96\x01\x01\x01" + _deep(b"\x91") + b"\x00\xa7msgpack"


def shapes(rng: random.Random) -> bytes:
    """Well-formed msgpack of the wrong shape."""
    return bytes(msgpack.packb(hostile_object(rng)))


@functools.cache
def _huge(fill: int) -> bytes:
    return bytes([fill]) * HUGE_BYTES


def huge(rng: random.Random) -> bytes:
    return _huge(rng.choice((ord("x"), 0xFF, ord("\n"), 0x91)))


def noise(rng: random.Random) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))


Family = Callable[[random.Random], bytes]
FAMILIES: dict[str, Family] = {
    "non_utf8": non_utf8,
    "numbers": numbers,
    "separators": separators,
    "nesting": nesting,
    "shapes": shapes,
    "huge": huge,
    "noise": noise,
}
# Writers that replace a key by one of another Redis type take this family, not the others.
WRONG_TYPE = "wrong_type"


def hostile_object(rng: random.Random, depth: int = 0) -> Any:
    """A msgpack-encodable value of a type or size no field of the layout expects."""
    simple: list[Any] = [
        None,
        True,
        False,
        -1,
        0,
        2**64 - 1,
        -(2**63),
        1.5,
        float("nan"),
        float("inf"),
        float("-inf"),
        "",
        "x" * 5000,
        b"\xff\xfe",
        "a\nb",
        ":{x}#",
        msgpack.ExtType(1, b"\x00"),
        msgpack.ExtType(2, bytes(msgpack.packb(["float32", [1 << 30], b""]))),
    ]
    if depth < 3 and rng.random() < 0.3:
        n = rng.randrange(0, 4)
        if rng.random() < 0.5:
            return [hostile_object(rng, depth + 1) for _ in range(n)]
        return {str(i): hostile_object(rng, depth + 1) for i in range(n)}
    return rng.choice(simple)
