"""The units options are written in, each parsed by one function (durations: ``10ms``, ``2s``;
byte sizes: ``4GiB``), and the pydantic validators every option model builds its fields from.

Ints are strict: ``True`` is no batch size, and neither is ``"4"`` given to ``qs.Serving``.
Text (a flag, an environment variable, a value read from Redis) becomes a value through
``from_text`` first, by the field's type.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import PlainValidator, ValidationError, ValidationInfo

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(us|ms|s|m|h)?\s*$")
_BYTE_UNITS = {
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "b": 1,
}


def parse_duration(value: str | float | int, *, what: str = "duration") -> float:
    """Seconds from ``value``; strings take a unit (us, ms, s, m, h; seconds without one)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be seconds or a string like '10ms', got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if not match:
            raise ValueError(
                f"{what} {value!r:.60} is not a duration; write it like '10ms', '2s', '1.5m' "
                "or '0.1'"
            )
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    else:
        raise TypeError(f"{what} must be seconds or a string like '10ms', got {value!r:.60}")
    if seconds < 0 or seconds != seconds:
        raise ValueError(f"{what} must be >= 0, got {value!r:.60}")
    return seconds


def parse_bytes(value: int | str, what: str) -> int:
    """``2GiB``, ``512MB``, ``1e9`` or a plain int, as bytes."""
    example = f"{what} must be a number of bytes like 2GiB or 512MB, got {value!r:.60}"
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(example)
    if isinstance(value, int):
        number = value
    else:
        text = value.strip().replace(" ", "")
        unit = next((u for u in _BYTE_UNITS if text.lower().endswith(u)), "")
        try:
            number = int(float(text[: len(text) - len(unit)]) * _BYTE_UNITS.get(unit, 1))
        except (ValueError, OverflowError):  # "inf" is a float, but no number of bytes
            raise ValueError(example) from None
    if number < 1:
        raise ValueError(f"{what} must be positive, got {value!r:.60}")
    return number


def count(
    low: int, high: int | None = None, *, says: str | None = None, type_error: bool = False
) -> PlainValidator:
    """An int from ``low`` to ``high`` (no bound: None); ``says`` words the range in the
    message. A value of another type is a TypeError with ``type_error``, else a ValueError."""
    span = says or (f"from {low} to {high}" if high is not None else f">= {low}")

    def check(value: Any, info: ValidationInfo) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            if type_error:
                raise TypeError(
                    f"{info.field_name} must be an int {span}, got {value!r:.60} "
                    f"({type(value).__name__})"
                )
        elif low <= value and (high is None or value <= high):
            return value
        raise ValueError(f"{info.field_name} must be an int {span}, got {value!r:.60}")

    return PlainValidator(check)


def number(*, above_zero: bool, says: str) -> PlainValidator:
    """An int or float (not NaN), > 0 (``above_zero``) or >= 0, as a float."""

    def check(value: Any, info: ValidationInfo) -> float:
        if (
            not isinstance(value, bool)
            and isinstance(value, int | float)
            and (value > 0 if above_zero else value >= 0)
        ):  # NaN is neither
            return float(value)
        raise ValueError(f"{info.field_name} must be {says}, got {value!r:.60}")

    return PlainValidator(check)


def duration(ceiling: float | None = None) -> PlainValidator:
    """Seconds, or text with a unit (``parse_duration``), at most ``ceiling`` when given."""

    def check(value: Any, info: ValidationInfo) -> float:
        what = info.field_name or "duration"
        seconds = parse_duration(value, what=what)
        if ceiling is not None and not seconds <= ceiling:  # also inf: 400 digits are inf
            raise ValueError(
                f"{what} must be a duration from 0 to {ceiling:.0f}s, got {value!r:.60}"
            )
        return seconds

    return PlainValidator(check)


class _Text:
    """Marks a field whose validator reads text itself (``from_text`` leaves it as text)."""


TAKES_TEXT = _Text()


def _bytes(value: Any, info: ValidationInfo) -> int:
    return parse_bytes(value, info.field_name or "size")


# Bytes, or text with a unit (``parse_bytes``).
ByteSize = Annotated[int, PlainValidator(_bytes), TAKES_TEXT]


def checked_by(check: Callable[[Any], Any]) -> PlainValidator:
    """A field checked by a function of the value alone that says what was wrong."""
    return PlainValidator(lambda value: check(value))


def flag(value: Any, info: ValidationInfo) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{info.field_name} must be True or False, got {value!r:.60}")
    return value


Flag = Annotated[bool, PlainValidator(flag)]


def problem(error: ValidationError) -> str:
    """What was wrong, in one line: pydantic's own text spans lines and echoes the value."""
    said = []
    for e in error.errors():
        message = str(e["msg"]).removeprefix("Value error, ")
        where = ".".join(str(part) for part in e["loc"])
        if e["type"] == "extra_forbidden":
            message = f"{where!r} is not an option"
        elif e["type"] != "value_error" and where:
            message = f"{where}: {message}"
        said.append(message)
    return "; ".join(said)


def from_text(name: str, annotation: Any, text: str) -> Any:
    """The value ``text`` stands for in a field of type ``annotation`` (an environment
    variable, a flag, a value read from Redis), for the field's validator to check."""
    kind = _plain(annotation)
    if _takes_text(annotation):
        return text
    if kind is bool:
        if text not in ("True", "False"):
            raise ValueError(f"{name} must be True or False, got {text!r:.60}")
        return text == "True"
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {text!r:.60}") from None
    if kind is tuple:
        return tuple(part for part in text.split(",") if part)
    if kind == (int, str):  # "auto" or a number
        return int(text) if text.isascii() and text.isdigit() else text
    return text


def _takes_text(annotation: Any) -> bool:
    if get_origin(annotation) is Annotated:
        return any(m is TAKES_TEXT for m in annotation.__metadata__)
    return any(_takes_text(a) for a in get_args(annotation))


def _plain(annotation: Any) -> Any:
    """int for ``Annotated[int, ...] | None``; tuple for ``tuple[str, ...]``; a tuple of
    the types of another union."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = tuple(_plain(a) for a in get_args(annotation) if a is not type(None))
        return kinds[0] if len(kinds) == 1 else kinds
    return get_origin(annotation) or annotation
