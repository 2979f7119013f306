"""The key tables of docs/architecture.md (every key) and docs/protocol.md (the keys a producer
touches) against the layout the code holds (``LAYOUT``): a key added, renamed or retyped in
one place and not the other fails here, as the fuzz registry's test does for the layout drawn in
the module's docstring."""

from __future__ import annotations

import re
from pathlib import Path

from queueserve.wire.keys import LAYOUT

DOCS = Path(__file__).resolve().parents[2] / "docs"
# a layout kind kept only to adopt what writers before wire 1 left (wire/keys.py's layout): no
# reader of the docs needs it
LEGACY = {"keys"}


def kind_of(name: str) -> str:
    """``P:{S}:in:K`` -> ``in``, ``P:inbox:C`` -> ``inbox``, ``:seen`` -> ``seen``."""
    rest = name.removeprefix("P:").removeprefix("{S}:").lstrip(":")
    return rest.split(":", 1)[0]


def key_rows(doc: str, header: str) -> list[tuple[list[str], list[str]]]:
    """The rows of the table under ``header`` in ``doc``: the kinds its first cell names and
    the types its second cell gives (none when it is empty)."""
    text = (DOCS / doc).read_text()
    table = text[text.index(header) :].split("\n\n| key |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        kinds = [kind_of(name) for name in re.findall(r"`([^`]+)`", cells[0])]
        types = [t.strip().removeprefix("pub/sub ") for t in cells[1].split(",") if t.strip()]
        rows.append((kinds, types))
    return rows


def documented(rows: list[tuple[list[str], list[str]]]) -> dict[str, str]:
    found: dict[str, str] = {}
    for kinds, types in rows:
        assert len(types) in (0, 1, len(kinds)), (kinds, types)
        for i, kind in enumerate(kinds):
            assert kind not in found, f"{kind} twice"
            found[kind] = types[i] if len(types) == len(kinds) else types[0] if types else ""
    return found


def test_the_architecture_table_names_every_key_of_the_layout_with_its_type() -> None:
    rows = documented(key_rows("architecture.md", "## Redis key layout"))
    assert rows == {kind: kind_type for kind, kind_type in LAYOUT if kind not in LEGACY}


def test_the_protocol_table_names_layout_keys_with_their_types() -> None:
    layout = dict(LAYOUT)
    rows = documented(key_rows("protocol.md", "## Keys"))
    assert rows.keys() <= layout.keys(), rows.keys() - layout.keys()
    typed = {kind: kind_type for kind, kind_type in rows.items() if kind_type}
    assert typed == {kind: layout[kind] for kind in typed}
    # what a producer needs: where it sends and reads, and what it passes to the scripts
    assert {"meta", "in", "pN", "queued", "ready", "wake", "inbox", "once", "cached"} <= rows.keys()


def test_kind_of_reads_each_way_the_tables_name_a_key() -> None:
    assert [kind_of(n) for n in ("P:{S}:in:K", "P:inbox:C", ":seen", "P:jobs:C:G")] == [
        "in",
        "inbox",
        "seen",
        "jobs",
    ]
