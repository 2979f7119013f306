"""Every "docs/design.md §n" cited in the repository names a section that exists, and nothing
cites the design by another name or points outside the repository for it."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.helpers import REPO

DESIGN = REPO / "docs" / "design.md"
CITING = ["queueserve", "tests", "bench", "tasks", "docs"]
CITATION = re.compile(r"docs/design\.md §(\d+)(?:\.(\d+))?")


def cited_files() -> list[Path]:
    files = [p for d in CITING for p in (REPO / d).rglob("*") if p.suffix in {".py", ".md", ".lua"}]
    return [*files, REPO / "README.md"]


def sections() -> dict[int, list[int]]:
    """Section number -> numbers of its numbered items (``1.``, ``2.``...)."""
    found: dict[int, list[int]] = {}
    current = None
    for line in DESIGN.read_text().splitlines():
        if m := re.match(r"## (\d+)\. ", line):
            current = int(m.group(1))
            found[current] = []
        elif current is not None and (m := re.match(r"(\d+)\. \*\*", line)):
            found[current].append(int(m.group(1)))
    return found


def test_sections_are_numbered_in_order() -> None:
    assert list(sections()) == list(range(1, len(sections()) + 1))
    assert len(sections()) >= 8


def test_every_citation_names_an_existing_section() -> None:
    known = sections()
    broken, count = [], 0
    for path in cited_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in CITATION.finditer(line):
                count += 1
                section, item = int(m.group(1)), m.group(2)
                if section not in known or (item and int(item) not in known[section]):
                    broken.append(f"{path.relative_to(REPO)}:{n}: {m.group(0)}")
    assert count > 30, f"only {count} citations found: is the pattern still right?"
    assert not broken, "citations of sections docs/design.md lacks:\n" + "\n".join(broken)


def test_nothing_cites_the_design_under_another_name_or_outside_the_repository() -> None:
    stray = re.compile(r"\bDESIGN(?:\.md)? §|shared/DESIGN|/work/shared")
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in cited_files()
        if path != Path(__file__)
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if stray.search(line)
    ]
    assert not found, "cite docs/design.md §n instead:\n" + "\n".join(found)
