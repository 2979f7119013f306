"""Every "docs/design.md §n" cited in the repository names a section that exists, and nothing
cites the design by another name or points outside the repository for it; every path, module,
test file and test name README.md and docs/*.md cite exists in the tree.

The rule for those citations (``stale_citations``):

- a path under a top directory of the repository (``tests/…``, ``bench/…``, ``scripts/…``,
  ``tasks/…``, ``docs/…``, ``deploy/…``, ``queueserve/…``) names a file or folder that exists;
- ``path.py::test_x`` names a ``def test_x`` in that file; a ``::test_x`` without a path (the
  next test of a table cell) names one in the last ``.py`` path cited before it;
- a bare ``test_x`` names a ``def test_x`` in some file under tests/;
- a bare ``test_x.py`` names a file under tests/;
- a name the docs abbreviate with an ellipsis (``test_x_…`` or ``test_x_...``) names a test
  whose name starts with what precedes the ellipsis; parametrize ids (``[a/b]``) are not checked;
- ``bench.x`` and ``python -m a.b`` name a module of the repository (``bench/x.py``, ``a/b.py``
  or a package folder).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.helpers import REPO

DESIGN = REPO / "docs" / "design.md"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
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


# --- citations of paths, modules and tests ---------------------------------------------------
TOP = "tests|bench|scripts|tasks|docs|deploy|queueserve"
PATH = re.compile(rf"(?<![\w/.-])(?:{TOP})/[\w./-]*[\w/]")
TEST = re.compile(r"(?P<sep>::\s*)?(?<![\w/.])(?P<name>test_\w+)(?P<tail>…|\.\.\.|\.py\b)?")
MODULE = re.compile(r"(?<![\w./-])bench\.\w+|(?<=python -m )\w+(?:\.\w+)+")


def defined_tests() -> dict[str, set[str]]:
    """Each file under tests/ (relative path) -> the names of the tests it defines."""
    define = re.compile(r"^\s*(?:async\s+)?def (test_\w+)", re.M)
    return {
        str(p.relative_to(REPO)): set(define.findall(p.read_text()))
        for p in (REPO / "tests").rglob("*.py")
    }


def _defined(name: str, abbreviated: bool, names: set[str]) -> bool:
    return any(n.startswith(name) for n in names) if abbreviated else name in names


def _test_name_problem(m: re.Match[str], text: str, defs: dict[str, set[str]]) -> str | None:
    name, tail = m.group("name"), m.group("tail")
    if tail == ".py":
        files = {Path(f).name for f in defs}
        return None if f"{name}.py" in files else "no such file under tests/"
    abbreviated = tail is not None
    if m.group("sep") is None:
        everywhere = set().union(*defs.values())
        return None if _defined(name, abbreviated, everywhere) else "no such test under tests/"
    cited = [p for p in PATH.findall(text, 0, m.start()) if p.endswith(".py")]
    if not cited or cited[-1] not in defs:
        return "no tests/….py path cited before it"
    if _defined(name, abbreviated, defs[cited[-1]]):
        return None
    return f"no such test in {cited[-1]}"


def stale_citations(text: str, defs: dict[str, set[str]]) -> tuple[int, list[str]]:
    """How many citations ``text`` holds, and "line N: citation: what is wrong" for each one
    naming what the tree lacks (the rule is in this module's docstring)."""
    found: list[tuple[int, str]] = []
    count = 0
    for m in PATH.finditer(text):
        count += 1
        if not (REPO / m.group(0)).exists():
            found.append((m.start(), f"{m.group(0)}: no such file or folder"))
    for m in MODULE.finditer(text):
        count += 1
        module = REPO / m.group(0).replace(".", "/")
        if not (module.with_suffix(".py").exists() or module.is_dir()):
            found.append((m.start(), f"{m.group(0)}: no such module"))
    for m in TEST.finditer(text):
        count += 1
        if problem := _test_name_problem(m, text, defs):
            found.append((m.start(), f"{m.group(0).strip(': ')}: {problem}"))
    return count, [f"line {text.count(chr(10), 0, at) + 1}: {what}" for at, what in sorted(found)]


def test_every_path_module_and_test_the_docs_cite_exists() -> None:
    defs = defined_tests()
    total, stale = 0, []
    for doc in DOCS:
        count, problems = stale_citations(doc.read_text(), defs)
        total += count
        stale += [f"{doc.relative_to(REPO)} {p}" for p in problems]
    assert total > 300, f"only {total} citations found: are the patterns still right?"
    assert not stale, "the docs cite what the tree lacks:\n" + "\n".join(stale)


def test_the_citation_check_finds_each_kind_of_stale_citation() -> None:
    docs, charlm = "tests/unit/test_docs.py", "tests/unit/test_charlm.py"
    defs = {docs: {"test_one", "test_two_long_name"}, charlm: {"test_three"}}
    good = (
        f"`{docs}::test_one`, `::test_two_…`; `test_three`, `test_charlm.py`, "
        f"`{docs}::\ntest_two_long_name[x/y]`, `python -m bench.soak`"
    )
    assert stale_citations(good, defs) == (8, [])
    bad = (
        f"`tests/test_embed.py`\n`{charlm}::test_one`, `::test_two…`\n"
        "`test_four`, `test_c.py`, `test_fo…`, `bench.nothing`"
    )
    _, problems = stale_citations(bad, defs)
    assert problems == [
        "line 1: tests/test_embed.py: no such file or folder",
        f"line 2: test_one: no such test in {charlm}",
        f"line 2: test_two…: no such test in {charlm}",
        "line 3: test_four: no such test under tests/",
        "line 3: test_c.py: no such file under tests/",
        "line 3: test_fo…: no such test under tests/",
        "line 3: bench.nothing: no such module",
    ], problems


def test_the_changelog_names_the_wire_version_and_every_header_field_read() -> None:
    """A new optional header field or wire version is news for whoever upgrades: CHANGELOG.md's
    wire paragraph names them as this version reads them."""
    from queueserve.wire.protocol import WIRE_VERSION
    from queueserve.wire.request import FIELDS

    changelog = (REPO / "CHANGELOG.md").read_text()
    wire = changelog.split("**Wire format.**", 1)[1].split("\n\n", 1)[0]
    assert f"Wire version {WIRE_VERSION} throughout" in wire
    named = re.search(r"Optional header fields this version reads: ([^.]*)\.", wire)
    assert named is not None
    assert re.findall(r"`([a-z_]+)`", named.group(1)) == list(FIELDS)
