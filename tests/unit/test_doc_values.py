"""What the docs show a call returning has the shape the call returns: each ``job.progress()``
in a python block of README.md or docs/*.md whose comment shows its value, and the methods
table of docs/usage.md, against ``JobProgress`` (what ``qs.Job.progress`` and
``qs.AsyncJob.progress`` are annotated to return).
"""

from __future__ import annotations

import ast
import re
import typing
from typing import Any

from queueserve.client.job_handles import AsyncJob, Job, JobProgress
from tests.support.helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PYTHON_BLOCK = re.compile(r"^\s*```python\n(.*?)^\s*```", re.M | re.S)


def shown_values(method: str) -> list[tuple[str, Any]]:
    """(where, value) for each call of ``.method()`` on a python-block line whose comment
    shows what the line's expression gives (``a(), b()  # x, y``: b's is y)."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for block in PYTHON_BLOCK.finditer(text):
            first = text.count("\n", 0, block.start(1)) + 1
            for n, line in enumerate(block.group(1).splitlines(), first):
                code, _, comment = line.partition("  # ")
                if f".{method}()" not in code or not comment:
                    continue
                calls = ast.parse(code.strip(), mode="eval").body
                values = ast.literal_eval(comment.strip())
                if not isinstance(calls, ast.Tuple):
                    calls, values = ast.Tuple(elts=[calls]), (values,)
                for call, value in zip(calls.elts, values, strict=True):
                    if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == method:
                        found.append((f"{path.relative_to(REPO)}:{n}", value))
    return found


def test_job_progress_is_shown_as_the_triple_it_returns() -> None:
    # Given what Job.progress returns: a (done, total, hook) named tuple
    for job in (Job, AsyncJob):
        assert typing.get_type_hints(job.progress)["return"] is JobProgress
    fields = JobProgress._fields
    assert fields == ("done", "total", "hook")

    # Then every value the docs show for it has that shape
    shown = shown_values("progress")
    assert shown, "no job.progress() with its value in a comment: is the pattern still right?"
    for where, value in shown:
        assert isinstance(value, tuple) and len(value) == len(fields), (
            f"{where}: job.progress() shown as {value!r}; it returns ({', '.join(fields)})"
        )

    # And the methods table names its fields
    usage = (REPO / "docs" / "usage.md").read_text()
    (row,) = [line for line in usage.splitlines() if line.startswith("| `progress()` |")]
    assert f"`({', '.join(fields)})`" in row
