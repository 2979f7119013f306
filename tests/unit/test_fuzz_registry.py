"""The fuzzer's registry (tests/faults/fuzz/surfaces.py) covers the whole key layout: a key,
channel or entry field added to ``wire/protocol.py`` without a fuzz entry fails here, and so
does a layout table in its docstring that LAYOUT no longer matches."""

from __future__ import annotations

import re

from queueserve.wire import protocol as P
from tests.faults.fuzz.surfaces import SURFACES
from tests.faults.fuzz.values import FAMILIES, WRONG_TYPE

# A row of the docstring's table: "    P:{S}:in:K        stream   requests of ..."
_ROW = re.compile(
    r"^ {4}P:(?:\{S\}:)?([A-Za-z]+)\S*\s+(stream|zset|hash|set|string|channel|list)\s",
    re.MULTILINE,
)


def documented_layout() -> list[tuple[str, str]]:
    assert P.__doc__ is not None
    return _ROW.findall(P.__doc__)


def test_the_docstring_table_and_layout_name_the_same_keys_and_types() -> None:
    assert documented_layout() == list(P.LAYOUT)


def test_every_key_name_keys_builds_is_a_layout_kind() -> None:
    keys = P.Keys("P", "S")
    built = {
        name
        for name in P.Keys.__slots__
        if not name.startswith("_")
        and isinstance(getattr(keys, name), str)
        and getattr(keys, name).startswith("P:{S}:")
    }
    assert built <= dict(P.LAYOUT).keys(), built - dict(P.LAYOUT).keys()


def test_every_layout_kind_and_entry_field_has_a_fuzz_surface() -> None:
    wanted = [kind for kind, _ in P.LAYOUT] + [f"entry.{f}" for f in P.ENTRY_FIELDS]
    registered = [s.kind for s in SURFACES]
    missing = [k for k in wanted if k not in registered]
    assert not missing, (
        f"no fuzz entry in tests/faults/fuzz/surfaces.py for {missing}: add a Surface with "
        "writers of hostile values for it"
    )
    assert sorted(registered) == sorted(wanted), "a surface names no kind of the layout"


def test_every_surface_has_attacks_of_known_value_families() -> None:
    for surface in SURFACES:
        assert surface.attacks, surface.kind
        for attack in surface.attacks:
            assert attack.families and set(attack.families) <= {*FAMILIES, WRONG_TYPE}, (
                surface.kind,
                attack.name,
            )
