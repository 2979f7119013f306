"""Mutation testing of one module with the tests that claim it (docs/testing.md).

    scripts/mutation MODULE TEST [TEST ...] [--rev REV] [--overlay PATH] [--max-children N]
    scripts/mutation queueserve/door/auth.py tests/unit/test_mutants_auth.py \\
        tests/integration/test_gateway_auth_bytes.py

1. A copy of the tree: a detached git worktree of REV (HEAD) in a temporary folder, so neither
   mutmut's mutants/ nor the mutated runs touch the checkout others test from. ``--overlay PATH``
   copies PATH from the checkout over it (a test not committed yet); the report says so.
2. ``mutmut run`` there, mutating MODULE only (its ``[tool.mutmut]`` is written into the copy's
   pyproject.toml). mutmut copies the tree into mutants/ and runs each mutant, in a fork of
   itself, against the named tests that reached the mutated function in its own process.
3. A recheck: each mutant mutmut did not kill runs again against every named test, in a fresh
   interpreter (``pytest -x``), after a clean run of them. The tests that reach the module
   only in a process they start (a gateway, a worker: ``child_env`` puts the mutants/ copy on
   its PYTHONPATH, and the mutant's name travels in MUTANT_UNDER_TEST) count too. With
   ``--fresh`` mutmut only makes the mutants and every one runs so: for a module the tests
   reach only in processes they start, where mutmut's own run finds no test for most.
   ``--also TEST`` names a test for this recheck only: a slow one, which mutmut would run for
   every mutant it meets (in an order of its own, not the order named), not for survivors only.
4. The report: mutants, killed (a timeout is a kill), equivalent, survived and the score
   killed / (mutants - equivalent); each survivor's change; a row for docs/testing.md.
   Equivalent mutants are read from scripts/mutation_equivalents.toml, matched by module,
   function and the lines changed (not by mutmut's number, which moves when the code does).

    scripts/mutation lua [SCRIPT ...] [--rev REV] [--overlay PATH]

The Lua scripts (queueserve/broker/lua/*.lua) no Python mutation tool reaches: each condition
recorded in scripts/mutation_lua.toml is flipped in a copy of the tree, one at a time, and the
test named with it must fail (a clean run of the named tests first must pass). The table it
prints is docs/testing.md's.

Exit status: 0 when the score reaches --min-score (85) (lua: when every flip fails its test), 1
when it does not, 2 when a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "scripts" / "mutation_equivalents.toml"
LUA_FLIPS = ROOT / "scripts" / "mutation_lua.toml"
LUA_DIR = "queueserve/broker/lua"
# What the tests import from the tree: copied into mutants/ (MODULE's mutated copy among them)
SOURCE_PATHS = ("queueserve", "tasks")
KILLED = frozenset({"killed", "timeout"})
RECHECKED = frozenset({"survived", "no tests", "suspicious", "segfault", "not checked"})
PYTEST_PLUGINS_OFF = ("-p", "no:randomly", "-p", "no:cacheprovider")
RUN_LIMIT_S = 1800  # one pytest run of a mutant: a hang is a kill (as mutmut's timeout is)
TIMED_OUT = -1
# pytest's exit codes that mean the mutant made a test fail (1), pytest itself fail (3), or
# collection fail (2: a mutant called while a test module is imported); or it hung
FAILED_RUN = frozenset({1, 2, 3, TIMED_OUT})


@dataclass(frozen=True)
class Equivalent:
    module: str
    function: str
    change: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Flip:
    """One condition of a Lua script, the text it is flipped to, and the test that must fail."""

    script: str  # a file of queueserve/broker/lua/
    condition: str  # what the code decides, in words
    original: str  # its text, found exactly once in the script
    flipped: str
    test: str  # a test node id


@dataclass
class Verdicts:
    statuses: dict[str, str]  # mutant name -> killed / timeout / survived ...
    changes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # survivors' changed lines
    equivalent: dict[str, Equivalent] = field(default_factory=dict)

    @property
    def mutants(self) -> int:
        return len(self.statuses)

    @property
    def killed(self) -> int:
        return sum(status in KILLED for status in self.statuses.values())

    @property
    def survivors(self) -> list[str]:
        return sorted(
            name
            for name, status in self.statuses.items()
            if status not in KILLED and name not in self.equivalent
        )

    @property
    def score(self) -> float:
        """killed / (mutants - equivalent), as a percentage; 100 when nothing is left to kill."""
        judged = self.mutants - len(self.equivalent)
        return 100.0 if judged == 0 else 100.0 * self.killed / judged


def function_of(mutant: str) -> str:
    """'Token.allows' for 'queueserve.door.auth.xǁTokenǁallows__mutmut_3', 'refused' for
    '....x_refused__mutmut_1': the function as the source names it."""
    mangled = mutant.partition("__mutmut_")[0].rpartition(".")[2]
    if mangled.startswith("xǁ"):
        return ".".join(mangled.split("ǁ")[1:])
    return mangled.removeprefix("x_")


def change_of(diff: str) -> tuple[str, ...]:
    """The lines a unified diff removes and adds, each as '-' or '+', a space and its text less
    the whitespace around it: what identifies a mutant across renumbering and reindenting."""
    lines = []
    for line in diff.splitlines():
        if line.startswith(("---", "+++")) or not line.startswith(("-", "+")):
            continue
        text = line[1:].strip()
        if text:
            lines.append(f"{line[0]} {text}")
    return tuple(lines)


def parse_change(text: str) -> tuple[str, ...]:
    """A recorded change ('- old' / '+ new' lines) in the form ``change_of`` gives."""
    lines = []
    for line in text.strip().splitlines():
        line = line.strip()
        if not line:
            continue
        if line[0] not in "-+":
            raise ValueError(f"a change line starts with '-' or '+', not {line!r}")
        lines.append(f"{line[0]} {line[1:].strip()}")
    return tuple(lines)


def load_equivalents(path: Path = EQUIVALENTS) -> list[Equivalent]:
    if not path.exists():
        return []
    records = tomllib.loads(path.read_text())
    unknown = set(records) - {"equivalent"}
    if unknown:
        raise ValueError(f"{path}: unknown tables {sorted(unknown)}; only [[equivalent]]")
    out = []
    for i, record in enumerate(records.get("equivalent", [])):
        keys = set(record)
        if keys != {"module", "function", "change", "why"}:
            raise ValueError(
                f"{path}: equivalent #{i + 1} has keys {sorted(keys)}; "
                "it needs module, function, change and why"
            )
        if not record["why"].strip():
            raise ValueError(f"{path}: equivalent #{i + 1} says no why")
        out.append(
            Equivalent(
                record["module"], record["function"], parse_change(record["change"]), record["why"]
            )
        )
    return out


def load_flips(path: Path = LUA_FLIPS) -> list[Flip]:
    records = tomllib.loads(path.read_text())
    out = []
    for i, record in enumerate(records.get("flip", [])):
        try:
            flip = Flip(**record)
        except TypeError as exc:
            raise ValueError(f"{path}: flip #{i + 1}: {exc}") from None
        if flip.original == flip.flipped:
            raise ValueError(f"{path}: flip #{i + 1} changes nothing")
        out.append(flip)
    return out


def flipped_source(source: str, flip: Flip) -> str:
    """``source`` with ``flip.original`` (there exactly once) replaced by ``flip.flipped``."""
    found = source.count(flip.original)
    if found != 1:
        raise ValueError(
            f"{flip.script}: {flip.original!r} is there {found} times, not once: update "
            f"{LUA_FLIPS.name}"
        )
    return source.replace(flip.original, flip.flipped)


def lua_row(flip: Flip, caught: bool) -> str:
    def code(text: str) -> str:
        return "`" + " ".join(text.split()).replace("|", "\\|") + "`"

    test = flip.test.replace("::", " ")
    verdict = "fails" if caught else "**passes**"
    return (
        f"| `{flip.script}` | {flip.condition} | {code(flip.original)} → {code(flip.flipped)} "
        f"| `{test}` {verdict} |"
    )


def match_equivalents(
    module: str, changes: dict[str, tuple[str, ...]], records: Iterable[Equivalent]
) -> tuple[dict[str, Equivalent], list[Equivalent]]:
    """The survivors (name -> changed lines) that a record calls equivalent, and the module's
    records that match no survivor (stale: the mutant is killed now, or the code moved)."""
    mine = [r for r in records if r.module == module]
    matched: dict[str, Equivalent] = {}
    used: set[int] = set()
    for name, change in changes.items():
        for i, record in enumerate(mine):
            if record.function == function_of(name) and record.change == change:
                matched[name] = record
                used.add(i)
                break
    return matched, [r for i, r in enumerate(mine) if i not in used]


def mutmut_section(module: str, tests: Sequence[str], also_copy: Sequence[str]) -> str:
    def toml_list(values: Iterable[str]) -> str:
        return "[" + ", ".join(json.dumps(v) for v in values) + "]"

    return (
        "[tool.mutmut]\n"
        "# written by scripts/mutation into its copy of the tree\n"
        f"source_paths = {toml_list(SOURCE_PATHS)}\n"
        f"only_mutate = {toml_list([module])}\n"
        f"also_copy = {toml_list(also_copy)}\n"
        f"pytest_add_cli_args_test_selection = {toml_list(tests)}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider"]\n'
    )


def with_mutmut_section(pyproject: str, section: str) -> str:
    """pyproject.toml's text with its [tool.mutmut] table (if any) replaced by ``section``."""
    kept = re.sub(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", "", pyproject)
    return kept.rstrip("\n") + "\n\n" + section


def table_row(module: str, verdicts: Verdicts, command: str, commit: str | None = None) -> str:
    """docs/testing.md's row; with ``commit``, the commit column after the module's."""
    at = f" {commit} |" if commit is not None else ""
    return (
        f"| `{module}` |{at} {verdicts.mutants} | {verdicts.killed} | {len(verdicts.equivalent)} "
        f"| {len(verdicts.survivors)} | {verdicts.score:.1f}% | `{command}` |"
    )


# --- running ----------------------------------------------------------------------------------


def say(text: str) -> None:
    print(f"mutation: {text}", flush=True)


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of mutmut and of each rerun: none of the caller's PYTHONPATH (the copy
    must be what is imported) or mutmut's variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "MUTANT_UNDER_TEST", "PY_IGNORE_IMPORTMISMATCH"}
    }
    env.update(extra)
    return env


def make_copy(rev: str, overlay: Sequence[str], where: Path) -> None:
    git("worktree", "add", "--quiet", "--detach", str(where), rev)
    for path in overlay:
        source, target = ROOT / path, where / path
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def also_copy(copy: Path) -> list[str]:
    """Every top-level entry of the copy but .git and the source paths: tests read docs/,
    bench/, README.md, scripts/ ... through their path from the tests folder."""
    return sorted(p.name for p in copy.iterdir() if p.name not in {".git", *SOURCE_PATHS})


def read_statuses(copy: Path, module: str) -> dict[str, str]:
    from mutmut.stats import status_by_exit_code

    meta = json.loads((copy / "mutants" / f"{module}.meta").read_text())
    return {name: status_by_exit_code[code] for name, code in meta["exit_code_by_key"].items()}


def record_kills(copy: Path, module: str, killed: Iterable[str]) -> None:
    """Write the recheck's kills into mutmut's record, so ``mutmut results`` in a kept copy
    agrees with the report."""
    path = copy / "mutants" / f"{module}.meta"
    meta = json.loads(path.read_text())
    for name in killed:
        meta["exit_code_by_key"][name] = 1
    path.write_text(json.dumps(meta, indent=4))


def pytest_run(
    copy: Path, tests: Sequence[str], mutant: str, log: Path, cwd: Path | None = None
) -> int:
    """pytest -x over ``tests`` in ``copy``'s mutants/ (or ``cwd``), with ``mutant`` active;
    TIMED_OUT once it ran RUN_LIMIT_S (its process group, workers included, is killed)."""
    with log.open("a") as out:
        out.write(f"\n===== {mutant!r}: pytest -x {' '.join(tests)}\n")
        out.flush()
        run = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-x", "-q", *PYTEST_PLUGINS_OFF, *tests],
            cwd=cwd or copy / "mutants",
            env=clean_env(MUTANT_UNDER_TEST=mutant) if cwd is None else clean_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return run.wait(timeout=RUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
            out.write(f"\n===== killed after {RUN_LIMIT_S} s\n")
            return TIMED_OUT


# pytest.main twice in one process, as mutmut calls it: the second call is where an id goes missing
COLLECT_TWICE = (
    "import sys, pytest; args = ['--collect-only', '-q', *sys.argv[1:]]; "
    "pytest.main(args); sys.exit(pytest.main(args))"
)


def collect(
    copy: Path, selection: Sequence[str], twice: bool = False
) -> subprocess.CompletedProcess[str]:
    how = ["-c", COLLECT_TWICE] if twice else ["-m", "pytest", "--collect-only", "-q"]
    return subprocess.run(
        [sys.executable, *how, *PYTEST_PLUGINS_OFF, *selection],
        cwd=copy,
        env=clean_env(),
        capture_output=True,
        text=True,
        check=False,
    )


def check_selectable(copy: Path, tests: Sequence[str]) -> None:
    """mutmut runs a mutant's tests by their node ids, calling pytest.main again and again in
    one process; from the second call on, pytest finds no test whose parametrize id holds a
    backslash (e.g. ids=repr of b"\\x0b"), and mutmut counts the usage error (exit 4) as a kill.
    Refuse such ids before they fake a score."""
    listed = collect(copy, tests)
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    if listed.returncode != 0 or not ids:
        raise RuntimeError(f"pytest cannot collect {' '.join(tests)}:\n{listed.stdout[-3000:]}")
    again = collect(copy, ids, twice=True)
    if again.returncode != 0:
        suspects = [i for i in ids if "\\" in i] or [again.stdout[-3000:] + again.stderr[-3000:]]
        raise RuntimeError(
            "pytest cannot select these tests by their ids when called again in one process, "
            "so mutmut would count each mutant they meet as killed; give them plain ids:\n  "
            + "\n  ".join(suspects)
        )


def diff_of(copy: Path, mutant: str) -> str:
    mutmut = Path(sys.executable).with_name("mutmut")
    return subprocess.run(
        [str(mutmut), "show", mutant],
        cwd=copy,
        env=clean_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# --fresh: what `mutmut run` does before it runs anything (mutmut 3.8's _run), and no more
GENERATE = """
import os
from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants
from mutmut.__main__ import setup_source_paths
from mutmut.mutation.trampoline import set_mutant_under_test
set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
copy_src_dir()
copy_also_copy_files()
setup_source_paths()
create_mutants(1)
"""


def mutate(args: argparse.Namespace, copy: Path) -> Verdicts:
    """Steps 2 and 3 in ``copy``; raises RuntimeError when a step fails."""
    pyproject = copy / "pyproject.toml"
    section = mutmut_section(args.module, args.tests, also_copy(copy))
    pyproject.write_text(with_mutmut_section(pyproject.read_text(), section))

    log = copy / "mutation.log"
    if args.fresh:
        say(f"mutmut makes the mutants; each runs in a fresh interpreter (its output: {log})")
        command = [sys.executable, "-c", GENERATE]
    else:
        check_selectable(copy, args.tests)
        say(f"mutmut run (its output: {log})")
        mutmut = Path(sys.executable).with_name("mutmut")
        command = [str(mutmut), "run", "--max-children", str(args.max_children)]
    with log.open("w") as out:
        rc = subprocess.run(
            command, cwd=copy, env=clean_env(), stdout=out, stderr=subprocess.STDOUT, check=False
        ).returncode
    if rc != 0:
        raise RuntimeError(f"mutmut exited {rc}; the end of {log}:\n{tail(log)}")
    statuses = read_statuses(copy, args.module)
    if not statuses:
        raise RuntimeError(f"mutmut made no mutant of {args.module}")

    again = sorted(name for name, status in statuses.items() if status in RECHECKED)
    if again:
        say(f"recheck: {len(again)} mutants against every named test, in a fresh interpreter")
        rerun_log = copy / "recheck.log"
        rc = pytest_run(copy, [*args.tests, *args.also], "", rerun_log)
        if rc != 0:
            raise RuntimeError(f"the named tests fail unmutated (exit {rc}):\n{tail(rerun_log)}")
        killed = []
        for i, name in enumerate(again, 1):
            rc = pytest_run(copy, [*args.tests, *args.also], name, rerun_log)
            status = "timeout" if rc == TIMED_OUT else "killed" if rc in FAILED_RUN else "survived"
            say(f"  [{i}/{len(again)}] {name}: {status} (pytest exit {rc})")
            if status == "killed":
                killed.append(name)
            statuses[name] = status
        record_kills(copy, args.module, killed)

    verdicts = Verdicts(statuses)
    changes = {
        name: change_of(diff_of(copy, name))
        for name, status in statuses.items()
        if status not in KILLED
    }
    verdicts.changes = changes
    verdicts.equivalent, stale = match_equivalents(args.module, changes, load_equivalents())
    for record in stale:
        say(
            f"stale record in {EQUIVALENTS.name}: {record.function} {list(record.change)} "
            "matches no surviving mutant (killed now, or the code changed): remove or update it"
        )
    return verdicts


def report(args: argparse.Namespace, verdicts: Verdicts, commit: str) -> None:
    statuses = verdicts.statuses.values()
    timeouts = sum(status == "timeout" for status in statuses)
    print()
    print(f"{args.module} at {commit}: {verdicts.mutants} mutants")
    print(f"  killed      {verdicts.killed}" + (f" ({timeouts} by a timeout)" if timeouts else ""))
    print(f"  equivalent  {len(verdicts.equivalent)} (scripts/mutation_equivalents.toml)")
    print(f"  survived    {len(verdicts.survivors)}")
    print(f"  score       {verdicts.score:.1f}% (killed / (mutants - equivalent))")
    for name in verdicts.survivors:
        print(f"\nsurvived: {name}")
        print(f"  function = {json.dumps(function_of(name))}")
        print("  change = '''")
        for line in verdicts.changes[name]:
            print(f"  {line}")
        print("  '''")
    fresh = ["--fresh"] if args.fresh else []
    also = [f"--also {t}" for t in args.also]
    command = " ".join(["scripts/mutation", *fresh, *also, args.module, *args.tests])
    print("\nthe row for docs/testing.md:")
    print(table_row(args.module, verdicts, command, commit))


def flip_all(flips: Sequence[Flip], copy: Path) -> list[bool]:
    """Each flip in ``copy``, one at a time: whether its test failed. RuntimeError when the
    named tests fail unflipped."""
    log = copy / "lua.log"
    tests = sorted({flip.test for flip in flips})
    say(f"clean run of the {len(tests)} tests named (the output of every run: {log})")
    rc = pytest_run(copy, tests, "", log, cwd=copy)
    if rc != 0:
        raise RuntimeError(f"the named tests fail unflipped (exit {rc}):\n{tail(log)}")
    caught = []
    for i, flip in enumerate(flips, 1):
        path = copy / LUA_DIR / flip.script
        source = path.read_text()
        path.write_text(flipped_source(source, flip))
        before = log.stat().st_size
        try:
            rc = pytest_run(copy, [flip.test], f"{flip.script}: {flip.flipped}", log, cwd=copy)
        finally:
            path.write_text(source)
        caught.append(rc in FAILED_RUN)
        with log.open() as out:
            out.seek(before)
            failed = re.findall(r"^FAILED (\S+)", out.read(), re.M)
        verdict = f"fails ({' '.join(failed)})" if caught[-1] else "PASSES"
        say(f"  [{i}/{len(flips)}] {flip.script}: {flip.condition}: {flip.test} {verdict}")
    return caught


def lua_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/mutation lua",
        description="flip each recorded condition of the Lua scripts; its test must fail",
    )
    parser.add_argument("scripts", nargs="*", help="only these (e.g. enqueue.lua)")
    parser.add_argument("--rev", default="HEAD", help="the commit to copy (default: HEAD)")
    parser.add_argument("--overlay", action="append", default=[], metavar="PATH")
    parser.add_argument("--keep", action="store_true", help="keep the copy")
    args = parser.parse_args(argv)
    flips = [f for f in load_flips() if not args.scripts or f.script in args.scripts]
    if not flips:
        parser.error(f"no flip in {LUA_FLIPS.name} for {' '.join(args.scripts)}")
    commit = git("rev-parse", "--short", args.rev)
    where = Path(tempfile.mkdtemp(prefix="qs-mutation-lua-"))
    say(f"copy of {commit} in {where}: {len(flips)} flips")
    try:
        make_copy(args.rev, args.overlay, where)
        for flip in flips:  # every record applies before anything runs
            flipped_source((where / LUA_DIR / flip.script).read_text(), flip)
        caught = flip_all(flips, where)
    except (RuntimeError, subprocess.CalledProcessError, ValueError) as exc:
        say(f"failed: {exc}")
        return 2
    finally:
        remove_copy(where, args.keep)
    print(
        f"\nthe rows for docs/testing.md ({commit}"
        + (" with --overlay" if args.overlay else "")
        + "):"
    )
    print("| script | condition | flipped | the test, run on the flipped script |")
    print("|---|---|---|---|")
    for flip, ok in zip(flips, caught, strict=True):
        print(lua_row(flip, ok))
    missed = caught.count(False)
    if missed:
        say(f"{missed} flips pass their test: the test does not hold the condition")
    return 1 if missed else 0


def remove_copy(where: Path, keep: bool) -> None:
    if keep:
        say(f"kept {where} (cd there; mutmut results, mutmut show NAME, mutmut browse)")
        return
    subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=ROOT, check=False)
    shutil.rmtree(where, ignore_errors=True)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/mutation",
        description="mutmut over one module with the tests that claim it, in a copy of the tree",
    )
    parser.add_argument("module", help="the file to mutate, e.g. queueserve/door/auth.py")
    parser.add_argument("tests", nargs="+", help="the test files (or node ids) that claim it")
    parser.add_argument("--rev", default="HEAD", help="the commit to copy (default: HEAD)")
    parser.add_argument(
        "--overlay",
        action="append",
        default=[],
        metavar="PATH",
        help="copy PATH from the checkout over the copy (e.g. a test not committed yet)",
    )
    parser.add_argument(
        "--max-children", type=int, default=1, help="mutants mutmut runs at once (default: 1)"
    )
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="TEST",
        help="a test for the recheck only (step 3): slow ones, so that mutmut's own run, which "
        "runs a mutant's tests in an order of its own, stays fast",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="skip mutmut's run: every mutant in a fresh interpreter against every named test "
        "(for a module the tests reach only in processes they start: a gateway, a worker)",
    )
    parser.add_argument("--min-score", type=float, default=85.0, help="exit 1 below this score")
    parser.add_argument("--keep", action="store_true", help="keep the copy (to mutmut browse it)")
    args = parser.parse_args(argv)
    if not args.module.endswith(".py") or args.module.split("/")[0] not in SOURCE_PATHS:
        parser.error(f"{args.module!r} is not a .py file under {' or '.join(SOURCE_PATHS)}/")
    for path in [args.module, *args.overlay, *(t.split("::")[0] for t in args.tests + args.also)]:
        if not (ROOT / path).exists():
            parser.error(f"{path!r} does not exist in {ROOT}")
    return args


def main(argv: Sequence[str] = sys.argv[1:]) -> int:
    if argv[:1] == ["lua"]:
        return lua_main(argv[1:])
    args = parse_args(argv)
    commit = git("rev-parse", "--short", args.rev)
    named = [args.module, *(t.split("::")[0] for t in args.tests + args.also)]
    for path in named:
        held = subprocess.run(
            ["git", "cat-file", "-e", f"{args.rev}:{path}"], cwd=ROOT, stderr=subprocess.DEVNULL
        ).returncode
        if held != 0 and not any(
            path == o or path.startswith(o.rstrip("/") + "/") for o in args.overlay
        ):
            say(f"{commit} holds no {path}: commit it, or name it with --overlay {path}")
            return 2
    changed = git("diff", "--name-only", args.rev, "--", *named).split()
    if changed:
        overlaid = [p for p in changed if p in args.overlay]
        if overlaid:
            say(f"overlaid from the checkout (not what {commit} holds): {' '.join(overlaid)}")
        rest = [p for p in changed if p not in args.overlay]
        if rest:
            say(f"the checkout's {' '.join(rest)} differs from {commit}; mutating {commit}'s")
    where = Path(tempfile.mkdtemp(prefix=f"qs-mutation-{Path(args.module).stem}-"))
    say(f"copy of {commit} in {where}")
    try:
        make_copy(args.rev, args.overlay, where)
        verdicts = mutate(args, where)
    except (RuntimeError, subprocess.CalledProcessError, ValueError) as exc:
        detail = getattr(exc, "stderr", None) or ""
        say(f"failed: {exc}\n{detail}")
        return 2
    finally:
        remove_copy(where, args.keep)
    report(args, verdicts, commit + (" with --overlay" if args.overlay else ""))
    return 0 if verdicts.score >= args.min_score else 1


if __name__ == "__main__":
    sys.exit(main())
