"""The lock's checks: what constraints.txt was computed from, and whether a venv matches it.

    python3 scripts/lockfile.py hash     # the hash of the lock's inputs (scripts/lock writes it)
    python3 scripts/lockfile.py check    # exit 1 when the running interpreter's installed
                                         # distributions or the inputs differ from the lock

Only the inputs of the resolution count toward the hash: pyproject.toml's requires-python,
dependencies and extras, and constraints.in's pins, so an edit to the tool settings in
pyproject.toml asks for no new lock. tests/unit/test_lock.py runs both checks in the suite.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from importlib import metadata

ROOT = pathlib.Path(__file__).resolve().parent.parent
HASH_LINE = re.compile(r"^# inputs-sha256: ([0-9a-f]{64})$", re.MULTILINE)
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
# The installer that reads the lock cannot be installed by it; the project is installed editable.
NOT_LOCKED = frozenset({"pip", "queueserve"})


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def inputs_hash(root: pathlib.Path = ROOT) -> str:
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    pins = [
        line.strip()
        for line in (root / "constraints.in").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    inputs = {
        "requires-python": project.get("requires-python"),
        "dependencies": project.get("dependencies", []),
        "optional-dependencies": project.get("optional-dependencies", {}),
        "pins": pins,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def locked_hash(lock_text: str) -> str | None:
    found = HASH_LINE.search(lock_text)
    return found.group(1) if found else None


def pins(lock_text: str) -> dict[str, str]:
    """{canonical name: exact version} of every ``name==version`` line of a lock."""
    out = {}
    for line in lock_text.splitlines():
        found = PIN.match(line)
        if found:
            out[canonical(found.group(1))] = found.group(2)
    return out


def installed() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}


def mismatches(locked: Mapping[str, str], present: Mapping[str, str]) -> list[str]:
    """One line per installed distribution that the lock does not pin at its version."""
    problems = []
    for name, version in sorted(present.items()):
        if name in NOT_LOCKED:
            continue
        if name not in locked:
            problems.append(f"{name}=={version} is installed but not in the lock")
        elif locked[name] != version and locked[name] != version.split("+")[0]:
            # PEP 440: ==2.13.0 admits 2.13.0+cpu (a pin names a version, not a build)
            problems.append(f"{name}=={version} is installed, the lock pins {locked[name]}")
    return problems


def stale(root: pathlib.Path = ROOT) -> str | None:
    """Why the lock no longer matches its inputs, or None."""
    have = locked_hash((root / "constraints.txt").read_text())
    want = inputs_hash(root)
    if have != want:
        return (
            f"constraints.txt was computed from other inputs (its hash {have}, now {want}): "
            "pyproject.toml's dependencies or constraints.in changed; run scripts/lock"
        )
    return None


def main(argv: Iterable[str]) -> int:
    command = next(iter(argv), "check")
    if command == "hash":
        print(inputs_hash())
        return 0
    problems = [p for p in [stale()] if p]
    problems += mismatches(pins((ROOT / "constraints.txt").read_text()), installed())
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
