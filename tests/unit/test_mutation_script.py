"""scripts/mutation's bookkeeping (scripts/mutation.py): how it names a mutant's function and
change, matches the recorded equivalent mutants (scripts/mutation_equivalents.toml) to the
survivors, scores a run and writes mutmut's settings into its copy; and that each record still
names code that exists, so a record left behind by a change of the code fails here, not in a
mutation run weeks later. Running mutmut itself is what the script is for (docs/testing.md)."""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutation", ROOT / "scripts" / "mutation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation"] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


mutation = load_script()

DIFF = """\
--- queueserve/door/auth.py
+++ queueserve/door/auth.py
@@ -1,4 +1,4 @@
 def allows(self, scope: Scope) -> bool:
-    given = next(v for k, v in scope["headers"])
+    given = next(v for k, v in scope["headers"])  or b"XX"
     return given
"""


def test_a_mutant_is_named_by_its_function_as_the_source_names_it() -> None:
    assert mutation.function_of("queueserve.door.auth.xǁTokenǁallows__mutmut_11") == (
        "Token.allows"
    )
    assert mutation.function_of("queueserve.door.auth.xǁTokenǁ__init____mutmut_3") == (
        "Token.__init__"
    )
    assert mutation.function_of("queueserve.door.auth.x_refused__mutmut_16") == "refused"
    assert mutation.function_of("tasks.paged_kv.x_x_y__mutmut_2") == "x_y"


def test_a_change_is_its_lines_less_their_indentation() -> None:
    assert mutation.change_of(DIFF) == (
        '- given = next(v for k, v in scope["headers"])',
        '+ given = next(v for k, v in scope["headers"])  or b"XX"',
    )
    recorded = """
        -   given = next(v for k, v in scope["headers"])
        +given = next(v for k, v in scope["headers"])  or b"XX"
    """
    assert mutation.parse_change(recorded) == mutation.change_of(DIFF)
    with pytest.raises(ValueError, match=r"starts with '-' or '\+'"):
        mutation.parse_change("  given = 1")


def record(function: str, change: str) -> object:
    return mutation.Equivalent("m.py", function, mutation.parse_change(change), "why")


def test_equivalents_match_by_function_and_change_not_by_number() -> None:
    survivors = {
        "m.x_f__mutmut_7": ("- a = 1", "+ a = 2"),  # was number 3 when recorded
        "m.x_f__mutmut_8": ("- a = 1", "+ a = 3"),
        "m.x_g__mutmut_1": ("- a = 1", "+ a = 2"),  # same change in another function
    }
    records = [
        record("f", "- a = 1\n+ a = 2"),
        record("f", "- b = 1\n+ b = 2"),  # nothing survives with it: stale
        mutation.Equivalent("other.py", "f", ("- a = 1", "+ a = 3"), "why"),
    ]
    matched, stale = mutation.match_equivalents("m.py", survivors, records)
    assert matched == {"m.x_f__mutmut_7": records[0]}
    assert stale == [records[1]]


def test_the_score_leaves_the_equivalent_mutants_out() -> None:
    statuses = {f"m.x_f__mutmut_{i}": "killed" for i in range(1, 17)}
    statuses |= {"m.x_f__mutmut_17": "timeout", "m.x_f__mutmut_18": "survived"}
    statuses |= {"m.x_f__mutmut_19": "survived", "m.x_f__mutmut_20": "survived"}
    verdicts = mutation.Verdicts(statuses)
    verdicts.equivalent = {"m.x_f__mutmut_19": record("f", "- a\n+ b")}
    assert (verdicts.mutants, verdicts.killed) == (20, 17)
    assert verdicts.survivors == ["m.x_f__mutmut_18", "m.x_f__mutmut_20"]
    assert verdicts.score == pytest.approx(100 * 17 / 19)
    row = mutation.table_row("m.py", verdicts, "scripts/mutation m.py t.py")
    assert row == "| `m.py` | 20 | 17 | 1 | 2 | 89.5% | `scripts/mutation m.py t.py` |"


def test_the_copy_gets_its_own_mutmut_settings_and_keeps_the_rest() -> None:
    pyproject = (
        '[project]\nname = "q"\n\n[tool.mutmut]\nonly_mutate = ["old.py"]\n\n[tool.x]\ny = 1\n'
    )
    section = mutation.mutmut_section("queueserve/a.py", ["tests/t.py"], ["docs", "bench"])
    written = tomllib.loads(mutation.with_mutmut_section(pyproject, section))
    assert written["project"] == {"name": "q"} and written["tool"]["x"] == {"y": 1}
    assert written["tool"]["mutmut"]["only_mutate"] == ["queueserve/a.py"]
    assert written["tool"]["mutmut"]["pytest_add_cli_args_test_selection"] == ["tests/t.py"]
    assert written["tool"]["mutmut"]["also_copy"] == ["docs", "bench"]
    assert written["tool"]["mutmut"]["source_paths"] == ["queueserve", "tasks"]


def test_each_recorded_equivalent_names_a_function_and_lines_that_exist() -> None:
    records = mutation.load_equivalents()
    assert records, "scripts/mutation_equivalents.toml holds no record"
    for r in records:
        source = (ROOT / r.module).read_text()
        name = r.function.rpartition(".")[2]
        assert re.search(rf"^\s*(async )?def {re.escape(name)}\(", source, re.M), r
        lines = {line.strip() for line in source.splitlines()}
        removed = [line[2:] for line in r.change if line.startswith("- ")]
        assert removed and all(line in lines for line in removed), (r.module, r.change)
        assert any(line.startswith("+ ") for line in r.change), r


def test_docs_testing_has_a_row_for_each_module_with_equivalents() -> None:
    doc = (ROOT / "docs" / "testing.md").read_text()
    rows = {m.group(1) for m in re.finditer(r"^\| `([^`]+\.py)` \|", doc, re.M)}
    assert {r.module for r in mutation.load_equivalents()} <= rows


def test_each_lua_flip_applies_to_its_script_and_names_a_test_that_exists() -> None:
    flips = mutation.load_flips()
    lua = ROOT / mutation.LUA_DIR
    assert {f.script for f in flips} == {p.name for p in lua.glob("*.lua")}, "a script unflipped"
    for flip in flips:
        source = (lua / flip.script).read_text()
        assert mutation.flipped_source(source, flip) != source  # there once, and changed
        path, _, name = flip.test.partition("::")
        assert (ROOT / path).is_file(), flip.test
        assert not name or re.search(rf"^(async )?def {name}\(", (ROOT / path).read_text(), re.M)


def test_a_flip_whose_text_is_not_there_once_is_refused() -> None:
    flip = mutation.Flip("x.lua", "c", "a > 0", "a >= 0", "tests/t.py")
    assert mutation.flipped_source("if a > 0 then", flip) == "if a >= 0 then"
    for source in ("if b > 0 then", "if a > 0 or a > 0 then"):
        with pytest.raises(ValueError, match="not once"):
            mutation.flipped_source(source, flip)
