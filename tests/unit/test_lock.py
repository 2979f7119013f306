"""The lock (constraints.txt): complete for what is installed, and computed from today's inputs.

scripts/test installs with ``pip install -c constraints.txt``; a distribution the lock does not
pin is one that pip chose from whatever the index published that morning, which is how a
redis-py release once turned a fresh clone's build red. docs/development.md says how to bump it.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_lockfile() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lockfile", ROOT / "scripts" / "lockfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lockfile = load_lockfile()
LOCK = (ROOT / "constraints.txt").read_text()


def test_the_lock_was_computed_from_todays_pyproject_and_pins() -> None:
    assert lockfile.stale(ROOT) is None


@pytest.mark.skipif(
    Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
    reason="checks the project's own .venv (scripts/test runs the suite in it)",
)
def test_every_installed_distribution_is_pinned_at_its_locked_version() -> None:
    assert lockfile.mismatches(lockfile.pins(LOCK), lockfile.installed()) == []


def test_the_lock_pins_the_release_the_build_was_checked_with() -> None:
    pins = lockfile.pins(LOCK)
    # the deliberate pins of constraints.in, and one transitive distribution for each extra
    assert pins["torch"] == "2.13.0"  # a version, not a build: the CUDA image takes its own
    assert pins["uvicorn"] == "0.54.0"
    for name in (
        "redis",
        "hiredis",
        "msgpack",
        "kombu",
        "starlette",
        "matplotlib",
        "pydantic-core",
    ):
        assert name in pins, name
    assert all(
        "==" in line
        for line in LOCK.splitlines()
        if line and not line.startswith(" ") and not line.startswith("#")
    )


def test_an_unpinned_or_other_version_is_reported() -> None:
    locked = {"redis": "8.1.0", "msgpack": "1.1.0", "torch": "2.13.0", "numpy": "2.4.6"}
    present = {
        "redis": "8.2.0",
        "msgpack": "1.1.0",
        "left-pad": "1.0",
        "pip": "26.0",
        "queueserve": "0.1.0",
        "torch": "2.13.0+cpu",  # the build on disk: PEP 440's == ignores the local label
        "numpy": "2.4.60",
    }
    assert lockfile.mismatches(locked, present) == [
        "left-pad==1.0 is installed but not in the lock",
        "numpy==2.4.60 is installed, the lock pins 2.4.6",
        "redis==8.2.0 is installed, the lock pins 8.1.0",
    ]


def test_names_are_compared_as_pip_normalizes_them() -> None:
    assert lockfile.pins("Typing_Extensions==4.15.0\n    # via x\n") == {
        "typing-extensions": "4.15.0"
    }
    assert lockfile.canonical("zope.interface") == "zope-interface"


@pytest.mark.parametrize(
    ("edit", "needs_new_lock"),
    [
        (lambda s: s.replace('"msgpack>=1.0"', '"msgpack>=1.1"'), True),
        (lambda s: s.replace('"pytest>=8"', '"pytest>=8",\n    "mutmut"'), True),
        (lambda s: s.replace("max-complexity = 10", "max-complexity = 11"), False),
    ],
)
def test_a_dependency_change_without_a_new_lock_fails(tmp_path: Path, edit, needs_new_lock) -> None:
    for name in ("pyproject.toml", "constraints.in", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    pyproject = tmp_path / "pyproject.toml"
    changed = edit(pyproject.read_text())
    assert changed != pyproject.read_text()
    pyproject.write_text(changed)
    assert (lockfile.stale(tmp_path) is not None) == needs_new_lock


def test_a_changed_deliberate_pin_needs_a_new_lock(tmp_path: Path) -> None:
    for name in ("pyproject.toml", "constraints.in", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    pins = tmp_path / "constraints.in"
    pins.write_text(pins.read_text().replace("uvicorn==0.54.0", "uvicorn==0.55.0"))
    assert "run scripts/lock" in (lockfile.stale(tmp_path) or "")
