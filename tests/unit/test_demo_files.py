"""Running the demo, or the indexing tasks as docs/indexing.md runs them from the checkout,
leaves no untracked folder for ``git status`` to show: the index goes outside the checkout or
where git ignores it."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest

from tasks.demo import demo_index_dir
from tasks.indexing import INDEX_FILE, resolve_index_dir
from tests.support.helpers import REPO


def left_in_checkout(folder: Path) -> str | None:
    """Why a file written in ``folder`` would show in ``git status``, or None."""
    folder = folder.resolve()
    if not folder.is_relative_to(REPO.resolve()):
        return None
    done = subprocess.run(
        ["git", "check-ignore", "-q", str(folder / INDEX_FILE)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    assert done.returncode in (0, 1), done.stderr  # 128: git failed
    return None if done.returncode == 0 else f"{folder} is in the checkout and not git-ignored"


def test_the_demo_writes_its_index_outside_the_checkout_or_where_git_ignores_it() -> None:
    with contextlib.ExitStack() as stack:
        folder = Path(demo_index_dir(stack))
        assert folder.is_dir()
        assert left_in_checkout(folder) is None
    assert not folder.exists()  # and removes it at the end


def test_the_tasks_default_index_folder_in_the_checkout_is_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given the tasks run from the checkout with no EMBED_INDEX_DIR (docs/indexing.md)
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("EMBED_INDEX_DIR", raising=False)
    folder = REPO / resolve_index_dir()
    assert folder.resolve().is_relative_to(REPO.resolve())
    assert left_in_checkout(folder) is None
