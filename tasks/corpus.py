"""A real corpus that needs no download: the docstrings of the Python standard library.

The standard library's source files are read with :mod:`ast` — never imported, so no module's
import-time side effects run (``antigravity`` opens a browser, ``this`` prints) — and every public
module, class, function and method docstring is cut into passages of at most ``max_words`` words
along paragraph boundaries. Order and ids are deterministic for one Python version:

    >>> from tasks.corpus import stdlib_passages
    >>> p = stdlib_passages(limit=3)
    >>> [x.id for x in p]   # the first passage of each of the first modules (Python 3.11)
    ['abc#0', 'aifc#0', 'antigravity:geohash#0']

``limit`` takes passages round-robin over modules (the first passage of every module, then the
second, ...), so a small corpus still spans the whole library and a semantic query about, say,
compression or CSV files finds its module.
"""

from __future__ import annotations

import ast
import re
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

MAX_WORDS = 120  # about 160 MiniLM tokens: under the model's 256-token window
MIN_WORDS = 4  # "Return self." carries nothing to search for
# Packages of tests, tools and GUIs: their docstrings describe test cases, not the library.
SKIP_PACKAGES = frozenset({"test", "idlelib", "lib2to3", "turtledemo", "ensurepip", "pydoc_data"})

_WS = re.compile(r"\s+")
_PARAGRAPH = re.compile(r"\n\s*\n")


@dataclass(frozen=True, slots=True)
class Passage:
    """One searchable chunk: ``id`` is ``module[:qualname]#n``; ``text`` is what gets embedded."""

    id: str
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_modules(root: Path | None = None) -> list[tuple[str, Path]]:
    """(dotted name, source file) of every public pure-Python stdlib module, sorted by name."""
    root = root or stdlib_dir()
    found: list[tuple[str, Path]] = []
    for top in sorted(sys.stdlib_module_names):
        if top.startswith("_") or top in SKIP_PACKAGES:
            continue
        package = root / top
        if (package / "__init__.py").is_file():
            for path in sorted(package.rglob("*.py")):
                rel = path.relative_to(root).with_suffix("").parts
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                if any(part.startswith("_") or part in SKIP_PACKAGES for part in rel[1:]):
                    continue
                if any(part in ("tests", "test") for part in rel):
                    continue
                found.append((".".join(rel), path))
        elif (root / f"{top}.py").is_file():
            found.append((top, root / f"{top}.py"))
    found.sort(key=lambda m: m[0])
    return found


def _docstrings(tree: ast.Module) -> Iterator[tuple[str, str]]:
    """(qualname, docstring) of the module ("") and its public classes, functions, methods."""
    doc = ast.get_docstring(tree)
    if doc:
        yield "", doc
    todo: list[tuple[str, ast.AST]] = [("", tree)]
    while todo:
        outer, node = todo.pop(0)
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if child.name.startswith("_"):
                continue
            qualname = f"{outer}.{child.name}" if outer else child.name
            doc = ast.get_docstring(child)
            if doc:
                yield qualname, doc
            if isinstance(child, ast.ClassDef):
                todo.append((qualname, child))


def chunk_text(doc: str, max_words: int = MAX_WORDS) -> list[str]:
    """Paragraphs packed into chunks of at most ``max_words`` words (whitespace collapsed); a
    paragraph longer than that is cut at word boundaries."""
    chunks: list[str] = []
    current: list[str] = []
    for paragraph in _PARAGRAPH.split(doc):
        words = paragraph.split()
        if current and len(current) + len(words) > max_words:
            chunks.append(" ".join(current))
            current = []
        while len(words) > max_words:
            chunks.append(" ".join(words[:max_words]))
            words = words[max_words:]
        current += words
    if current:
        chunks.append(" ".join(current))
    return chunks


def module_passages(name: str, path: Path, max_words: int = MAX_WORDS) -> list[Passage]:
    """The passages of one module, in source order; [] when its source does not parse."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    for qualname, doc in _docstrings(tree):
        base = f"{name}:{qualname}" if qualname else name
        for n, text in enumerate(chunk_text(doc, max_words)):
            if len(text.split()) >= MIN_WORDS:
                out.append(Passage(f"{base}#{n}", text))
    return out


def stdlib_passages(limit: int | None = None, max_words: int = MAX_WORDS) -> list[Passage]:
    """Passages of the whole standard library, each distinct text once.

    Without ``limit``: module by module in name order. With it: the first ``limit`` passages
    taken round-robin over modules, so the sample spans the library.
    """
    per_module = [module_passages(name, path, max_words) for name, path in stdlib_modules()]
    if limit is None:
        ordered: Iterator[Passage] = (p for passages in per_module for p in passages)
    else:
        ordered = (p for rnd in zip_longest(*per_module) for p in rnd if p is not None)
    seen: set[str] = set()
    out: list[Passage] = []
    for passage in ordered:
        if passage.text in seen:
            continue
        seen.add(passage.text)
        out.append(passage)
        if limit is not None and len(out) >= limit:
            break
    return out
