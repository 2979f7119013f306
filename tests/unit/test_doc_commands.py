"""Every ``queueserve ...`` command in a shell block (```bash, sh, shell, console) of README.md
and docs/*.md runs as written: its subcommand and flags parse with the real parser
(queueserve/ops/cli.py ``build_parser``), and each ``module:attr`` that ``queueserve worker``
names loads as a qs.Serving (``load_servings``, as the worker loads it).

A worker target is either in this repository (``tasks.*``, ``tests.support.*``) or in a module
the docs define themselves: prose that says ``module `myapp/servings.py` `` right after a python
block names that block as the module's source. The test writes each such module into a
temporary folder and loads every target in a fresh interpreter started there, as a user runs
the worker from the folder that holds ``myapp/``.

Unlabelled blocks are left alone: docs/operations.md's are synopses (``[--prefix P]``), and
docs/troubleshooting.md's are a worker's output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from contextlib import redirect_stderr
from dataclasses import dataclass
from io import StringIO
from pathlib import Path

from queueserve.ops.cli import build_parser
from tests.support.helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*```(\S*)")
DEFINES = re.compile(r"module `(?P<path>[\w/]+)\.py`")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {"&", "&&", ";", "|", "||"}

LOAD = """\
import json, sys
from queueserve.worker.loading import ServingNotFound, load_servings
found = {}
for spec in sys.argv[1:]:
    try:
        found[spec] = "ok: " + ", ".join(s.name for s in load_servings(spec))
    except ServingNotFound as e:
        found[spec] = f"error: {e}"
print(json.dumps(found))
"""


@dataclass(frozen=True)
class Command:
    where: str  # path:line
    argv: list[str]  # after "queueserve"


def blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of each fenced block, and ("prose", n, lines)
    between them."""
    found: list[tuple[str, int, list[str]]] = []
    language, start, lines = "prose", 1, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if m := FENCE.match(line):
            found.append((language, start, lines))
            language = (m.group(1) or "text") if language == "prose" else "prose"
            start, lines = n + 1, []
            continue
        lines.append(line)
    found.append((language, start, lines))
    return found


def commands_in(lines: list[str]) -> list[tuple[int, list[str]]]:
    """(line offset, argv after ``queueserve``) of each queueserve command in shell lines:
    continuation lines joined, comments dropped, commands split at ``&``, ``;``, ``|``, and
    leading ``VAR=value`` assignments skipped."""
    found: list[tuple[int, list[str]]] = []
    logical, first = "", 0
    for i, line in enumerate(lines):
        if not logical:
            first = i
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        lexer = shlex.shlex(logical + line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens, logical = list(lexer), ""
        command: list[str] = []
        for token in [*tokens, ";"]:
            if token not in SEPARATORS:
                command.append(token)
                continue
            while command and ASSIGNMENT.match(command[0]):
                command.pop(0)
            if command and Path(command[0]).name == "queueserve":
                found.append((first, command[1:]))
            command = []
    return found


def doc_commands() -> list[Command]:
    found = []
    for path in DOCS:
        for language, start, lines in blocks(path):
            if language in SHELL:
                for offset, argv in commands_in(lines):
                    found.append(Command(f"{path.relative_to(REPO)}:{start + offset}", argv))
    return found


def doc_modules() -> dict[str, str]:
    """Relative path -> source of each module the docs define: a python block, then prose
    that names it ``module `path.py` ``."""
    modules: dict[str, str] = {}
    for path in DOCS:
        previous: tuple[str, int, list[str]] | None = None
        for block in blocks(path):
            language, _, lines = block
            if language == "prose" and previous is not None and previous[0] == "python":
                for m in DEFINES.finditer(" ".join(lines[:3])):
                    modules[m.group("path") + ".py"] = "\n".join(previous[2]) + "\n"
            previous = block
    return modules


def parse(argv: list[str]) -> tuple[argparse.Namespace | None, str]:
    """The parsed namespace, or None and what argparse said."""
    said = StringIO()
    try:
        with redirect_stderr(said):
            return build_parser().parse_args(argv), ""
    except SystemExit:
        return None, said.getvalue().strip()


def load(specs: list[str], folder: Path) -> dict[str, str]:
    """What loading each spec gives, in a fresh interpreter whose current folder is
    ``folder`` (the repository on PYTHONPATH, as its editable install puts it)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", LOAD, *specs],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, str] = json.loads(done.stdout.splitlines()[-1])
    return found


def test_the_extraction_finds_commands_targets_and_modules() -> None:
    lines = [
        'export TOKEN=s3cret GW="http://localhost:8000"',
        "queueserve worker a.b:c --partitions 2 &   # a comment",
        "QUEUESERVE_GATEWAY_TOKEN=$TOKEN queueserve gateway --port 8000 &",
        ".venv/bin/queueserve worker x.y:z --redis-url redis://localhost:6379/0 \\",
        "    --batch-size 64",
        "curl -s $GW/healthz -H 'x: queueserve worker no:thing'",
        "# queueserve worker in:comment",
    ]
    assert commands_in(lines) == [
        (1, ["worker", "a.b:c", "--partitions", "2"]),
        (2, ["gateway", "--port", "8000"]),
        (3, ["worker", "x.y:z", "--redis-url", "redis://localhost:6379/0", "--batch-size", "64"]),
    ]
    assert "myapp/servings.py" in doc_modules()
    assert "serving = qs.Serving(" in doc_modules()["myapp/servings.py"]


def test_every_queueserve_command_in_the_docs_runs_as_written(tmp_path: Path) -> None:
    # Given every queueserve command of the docs' shell blocks, and the modules they define
    commands = doc_commands()
    assert len(commands) >= 5, f"only {len(commands)} commands found: is the extraction right?"
    for relative, source in doc_modules().items():
        module = tmp_path / relative
        module.parent.mkdir(parents=True, exist_ok=True)
        for package in module.relative_to(tmp_path).parents:
            (tmp_path / package / "__init__.py").touch()
        module.write_text(source)

    # When the CLI's own parser reads each, and each worker target is loaded
    problems, targets = [], {}
    for command in commands:
        args, said = parse(command.argv)
        if args is None:
            problems.append(f"{command.where}: queueserve {shlex.join(command.argv)}: {said}")
        elif args.command == "worker":
            for spec in args.servings:
                targets.setdefault(spec, []).append(command.where)
    assert any(spec.startswith("myapp.") for spec in targets), targets
    loaded = load(sorted(targets), tmp_path)

    # Then each parses, and each target is a qs.Serving
    problems += [
        f"{where}: queueserve worker {spec}: {loaded[spec]}"
        for spec, places in targets.items()
        for where in places
        if not loaded[spec].startswith("ok: ")
    ]
    assert not problems, "doc commands that fail as written:\n" + "\n".join(problems)


def test_readme_says_where_the_installed_command_is_before_it_first_runs_it() -> None:
    # The scripts install into .venv (scripts/_install.sh), so `queueserve` is not on PATH.
    readme = (REPO / "README.md").read_text()
    use = readme[readme.index("\n## Use\n") :]
    first = min(m.start() for m in re.finditer(r"(?m)^(?:\S*/)?queueserve \w", use))
    before = use[:first]
    assert re.search(r"source \.venv/bin/activate|\.venv/bin/queueserve", before), (
        "README.md's Use section runs `queueserve` without saying it is in .venv/bin"
    )
    assert "python3 -m venv .venv" in (REPO / "scripts" / "_install.sh").read_text()
    assert 'queueserve = "queueserve.ops.cli:main"' in (REPO / "pyproject.toml").read_text()
