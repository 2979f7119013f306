"""The package layout's rules (docs/architecture.md "Layout rules"), read from the source.

Every module under queueserve/ is parsed with ``ast``, and every import counts wherever it is
written: at the top, inside a function, under ``if TYPE_CHECKING:``, or as
``importlib.import_module("...")`` / ``__import__("...")`` with a literal name. The rules:

- only queueserve/broker/ imports ``redis``;
- no import cycles among queueserve modules;
- queueserve/worker/ never reaches queueserve/client/, and queueserve/client/ never reaches
  queueserve/worker/: not directly, not through other modules;
- queueserve/wire/ reaches nothing that does I/O (broker, client, worker, ops, redis, nor the
  standard library's sockets, processes or event loops);
- queueserve/wire/ never reaches queueserve/options/: the options are checked against the
  wire's facts (codecs, shard counts, timings), and read from Redis in options/stored.py;
- nothing outside queueserve/wire/ builds or parses a message: no msgpack or pickle, no
  codec's ``dumps``/``loads``, none of wire/codec.py's message helpers;
- queueserve/client/ imports of queueserve/broker/ name only the producer side (producer,
  async_producer, job_store) and its helpers (retry, urls, redis_errors): never the consumer,
  admin or core directly;
- every name in ``queueserve.__all__`` is importable from ``queueserve``.

The checker runs first on small synthetic packages, so each rule is known to fire.
"""

from __future__ import annotations

import ast
import importlib
import io
import tokenize
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.helpers import REPO

Graph = dict[str, list["Import"]]


@dataclass(frozen=True)
class Import:
    importer: str  # dotted name of the importing module
    where: str  # file:line, relative to the root
    target: str  # absolute dotted name: the module it names if that is one, else what it names
    statement: str

    def __str__(self) -> str:
        return f"{self.where} ({self.statement})"


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file, for every module of ``package`` under ``root``."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _is_dynamic_import(node: ast.Call) -> bool:
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in {"__import__", "import_module"}
    )
    return (
        named
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def _from_base(node: ast.ImportFrom, here: str, where: str) -> str:
    if not node.level:
        return node.module or ""
    parts = here.split(".")
    if node.level - 1 >= len(parts):
        raise AssertionError(f"{where}: relative import goes above the top package")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def imports_of(root: Path, name: str, path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    """Every import in one module, resolved to absolute names."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    rel = path.relative_to(root)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        where = f"{rel}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(name, where, alias.name, ast.unparse(node))
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, here, where)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                target = submodule if submodule in modules else base
                yield Import(name, where, target, ast.unparse(node))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node):
            literal = node.args[0]
            assert isinstance(literal, ast.Constant)
            yield Import(name, where, str(literal.value), ast.unparse(node))


def within(name: str, area: str) -> bool:
    return name == area or name.startswith(area + ".")


def import_graph(imports: list[Import], modules: dict[str, Path]) -> Graph:
    """Importer -> its imports of the package's own modules."""
    graph: Graph = {m: [] for m in modules}
    for imp in imports:
        if imp.target in modules and imp.target != imp.importer:
            graph[imp.importer].append(imp)
    return graph


def shortest_chain(
    graph: Graph, start: str, is_goal: Callable[[str], bool], allowed: set[str] | None = None
) -> list[Import] | None:
    """The shortest chain of imports from ``start`` to a module ``is_goal`` accepts (through
    ``allowed`` modules only, when given); None when there is none."""
    seen = {start}
    frontier: list[tuple[str, list[Import]]] = [(start, [])]
    while frontier:
        following = []
        for module, chain in frontier:
            for imp in graph[module]:
                if allowed is not None and imp.target not in allowed:
                    continue
                if is_goal(imp.target):
                    return [*chain, imp]
                if imp.target not in seen:
                    seen.add(imp.target)
                    following.append((imp.target, [*chain, imp]))
        frontier = following
    return None


def strongly_connected(graph: Graph) -> list[set[str]]:
    """Components of more than one module (Tarjan), i.e. where import cycles live."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in (imp.target for imp in graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while (w := stack.pop()) != v:
                component.add(w)
            component.add(v)
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def show(chain: list[Import]) -> str:
    names = " -> ".join([chain[0].importer, *(imp.target for imp in chain)])
    return names + "".join(f"\n      {imp}" for imp in chain)


def layout_problems(root: Path, package: str) -> dict[str, list[str]]:
    """Every broken layout rule of ``package`` (a folder under ``root``), by rule."""
    modules = module_files(root, package)
    imports = [i for name, path in modules.items() for i in imports_of(root, name, path, modules)]
    graph = import_graph(imports, modules)
    p = package

    def cycles() -> list[str]:
        out = []
        for component in strongly_connected(graph):
            start = min(component)
            chain = shortest_chain(graph, start, lambda m, s=start: m == s, component)
            assert chain is not None
            out.append(
                f"import cycle: {show(chain)}\n    break it: move what both need "
                "into a module that imports neither"
            )
        return out

    def reaching(area: str, forbidden: list[str], why: str) -> list[str]:
        out = []
        for module in sorted(m for m in modules if within(m, area)):
            chain = shortest_chain(graph, module, lambda m: any(within(m, f) for f in forbidden))
            if chain is not None:
                out.append(f"{module} reaches {chain[-1].target}: {show(chain)}\n    {why}")
        out += [
            f"{imp}: {area} imports {imp.target}\n    {why}"
            for imp in imports
            if within(imp.importer, area)
            and not within(imp.target, p)
            and any(within(imp.target, f) for f in forbidden)
        ]
        return out

    return {
        "redis": [
            f"{imp}: {imp.importer} imports {imp.target}, but only {p}/broker/ may import redis"
            f"\n    put the Redis operation behind {p}.broker and call that"
            for imp in imports
            if within(imp.target, "redis") and not within(imp.importer, f"{p}.broker")
        ],
        "cycles": cycles(),
        "worker->client": reaching(
            f"{p}.worker",
            [f"{p}.client"],
            "the worker must not depend on the client: share code through wire/",
        ),
        "client->worker": reaching(
            f"{p}.client",
            [f"{p}.worker"],
            "the client must not depend on the worker: share code through wire/",
        ),
        "wire": reaching(
            f"{p}.wire",
            [f"{p}.broker", f"{p}.client", f"{p}.worker", f"{p}.ops", "redis", *IO_MODULES],
            "wire/ holds names and formats only and must do no I/O",
        ),
        "wire->options": reaching(
            f"{p}.wire",
            [f"{p}.options"],
            "options/ depends on wire/, not the reverse: put what both need in wire/",
        ),
        "messages": _messages_outside_wire(root, modules, p),
        "client->producer": _producer_side_only(imports, p),
        "boundary": _reaching_into_the_broker(root, modules, p),
        "dashboard->gateway": reaching(
            f"{p}.dashboard",
            [f"{p}.gateway"],
            "the dashboard shares the HTTP door with the gateway (door/), not its modules",
        ),
    }


def _reaching_into_the_broker(root: Path, modules: dict[str, Path], p: str) -> list[str]:
    """Every place outside broker/ and client/ that reaches a client's or broker's Redis
    through an attribute (``x._broker``, ``x.redis`` of another object): the import rules
    cannot see it, and it crosses the boundary as an import would."""
    why = (
        f"only {p}/broker/ and {p}/client/ reach Redis: add a public method to the client "
        "(or the broker's audience) and call that"
    )
    out = []
    for name, path in sorted(modules.items()):
        if within(name, f"{p}.broker") or within(name, f"{p}.client"):
            continue
        rel = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and (
                node.attr == "_broker"
                or (
                    node.attr == "redis"
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")
                )
            ):
                out.append(f"{rel}:{node.lineno} ({ast.unparse(node)}): {why}")
    return out


# What client/ may import of broker/: the producer side and the helpers it hands out.
CLIENT_BROKER_MODULES = (
    "producer",
    "async_producer",
    "job_store",
    "retry",
    "urls",
    "redis_errors",
)


def _producer_side_only(imports: list[Import], p: str) -> list[str]:
    allowed = [f"{p}.broker.{m}" for m in CLIENT_BROKER_MODULES]
    return [
        f"{imp}: {imp.importer} imports {imp.target}, but the client uses only the producer "
        f"side of the broker\n    use {p}.broker.producer (or .async_producer); the consumer "
        "side is the worker's and the admin side ops/'s"
        for imp in imports
        if within(imp.importer, f"{p}.client")
        and within(imp.target, f"{p}.broker")
        and not any(within(imp.target, a) for a in allowed)
    ]


# What does I/O in the standard library (and the HTTP clients): wire/ imports none of it.
IO_MODULES = (
    "socket",
    "ssl",
    "selectors",
    "subprocess",
    "asyncio",
    "http",
    "urllib",
    "requests",
    "httpx",
    "aiohttp",
)
MESSAGE_MODULES = ("msgpack", "pickle")  # the formats messages are made of
WIRE_HELPERS = {"pack_plain", "codec_for_tag", "loads_tagged"}  # wire/codec.py's, for messages


def _messages_outside_wire(root: Path, modules: dict[str, Path], p: str) -> list[str]:
    """Every place outside wire/ that builds or parses a message itself."""
    why = f"only {p}/wire/ builds or parses messages: add it to {p}/wire/ and call that"
    out = []
    for name, path in sorted(modules.items()):
        if within(name, f"{p}.wire"):
            continue
        rel = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                named = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                helpers = (
                    {a.name for a in node.names} & WIRE_HELPERS
                    if isinstance(node, ast.ImportFrom)
                    else set()
                )
                if helpers or any(within(n, m) for n in named for m in MESSAGE_MODULES):
                    out.append(f"{rel}:{node.lineno} ({ast.unparse(node)}): {why}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("dumps", "loads")
                # json: HTTP bodies (the gateway's own parser); tomllib: configuration files
                and not (
                    isinstance(node.func.value, ast.Name)
                    and node.func.value.id in ("json", "tomllib")
                )
            ):
                out.append(f"{rel}:{node.lineno} ({ast.unparse(node.func)}): {why}")
    return out


def report(problems: list[str]) -> str:
    return f"{len(problems)} broken:\n" + "\n".join(f"  - {p}" for p in problems)


# --- the checker, on synthetic packages --------------------------------------------------


def write_package(root: Path, files: dict[str, str]) -> Path:
    for relative, source in {**files, "pkg/__init__.py": files.get("pkg/__init__.py", "")}.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            if parent != Path(".") and not (root / parent / "__init__.py").exists():
                (root / parent / "__init__.py").write_text("")
        path.write_text(source)
    return root


CLEAN = {
    "pkg/wire/protocol.py": "KEY = 'k'\n",
    "pkg/broker/producer.py": "import redis\nfrom pkg.wire.protocol import KEY\n",
    "pkg/broker/consumer.py": "from pkg.broker.producer import KEY\n",
    "pkg/client/sync.py": "from pkg.broker.producer import KEY\nfrom ..wire import protocol\n",
    "pkg/worker/run.py": "from pkg.broker import consumer\nfrom pkg.wire.protocol import KEY\n",
    "pkg/ops/cli.py": "from pkg.worker.run import KEY\nfrom pkg.client.sync import KEY as K\n",
    "pkg/door/auth.py": "TOKEN = 't'\n",
    "pkg/gateway/app.py": "from pkg.door.auth import TOKEN\nfrom pkg.client.sync import KEY\n",
    "pkg/dashboard/app.py": "from pkg.door.auth import TOKEN\nfrom pkg.options import serving\n",
    "pkg/options/serving.py": "from pkg.wire.protocol import KEY\n",
}


def test_a_package_that_keeps_every_rule_has_no_problems(tmp_path: Path) -> None:
    root = write_package(tmp_path, CLEAN)
    assert layout_problems(root, "pkg") == {
        "redis": [],
        "cycles": [],
        "worker->client": [],
        "client->worker": [],
        "wire": [],
        "wire->options": [],
        "client->producer": [],
        "messages": [],
        "boundary": [],
        "dashboard->gateway": [],
    }


@pytest.mark.parametrize(
    ("rule", "module", "source", "named"),
    [
        ("redis", "pkg/client/sync.py", "import redis.asyncio\n", "pkg/client/sync.py:1"),
        (
            "redis",
            "pkg/client/sync.py",
            "def f():\n    from redis import Redis\n",
            "pkg/client/sync.py:2",
        ),
        (
            "redis",
            "pkg/ops/cli.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import redis\n",
            "pkg/ops/cli.py:3",
        ),
        (
            "redis",
            "pkg/ops/cli.py",
            "import importlib\nimportlib.import_module('redis')\n",
            "pkg/ops/cli.py:2",
        ),
        (
            "cycles",
            "pkg/wire/protocol.py",
            "from pkg.broker import producer\n",
            "pkg.broker.producer -> pkg.wire.protocol -> pkg.broker.producer",
        ),
        (
            "cycles",
            "pkg/worker/extra.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .run import KEY\n",
            "pkg/worker/extra.py:3",
        ),
        (
            "worker->client",
            "pkg/worker/run.py",
            "def f():\n    import pkg.client.sync\n",
            "pkg/worker/run.py:2",
        ),
        (
            "worker->client",
            "pkg/worker/run.py",
            "from pkg.ops import cli\n",
            "pkg.worker.run -> pkg.ops.cli -> pkg.client.sync",
        ),
        (
            "client->worker",
            "pkg/client/sync.py",
            "from pkg.worker.run import KEY\n",
            "pkg/client/sync.py:1",
        ),
        (
            "wire",
            "pkg/wire/codec.py",
            "from pkg.broker.producer import KEY\n",
            "pkg/wire/codec.py:1",
        ),
        (
            "client->producer",
            "pkg/client/sync.py",
            "from pkg.broker.consumer import KEY\n",
            "pkg/client/sync.py:1",
        ),
        (
            "client->producer",
            "pkg/client/async_client.py",
            "from pkg.broker import consumer\n",
            "pkg/client/async_client.py:1",
        ),
        ("wire", "pkg/wire/codec.py", "import redis\n", "pkg/wire/codec.py:1"),
        (
            "wire->options",
            "pkg/wire/codec.py",
            "from pkg.options.serving import KEY\n",
            "pkg/wire/codec.py:1",
        ),
        (
            "wire->options",
            "pkg/wire/codec.py",
            "from pkg.dashboard import app\n",
            "pkg.wire.codec -> pkg.dashboard.app -> pkg.options.serving",
        ),
        ("wire", "pkg/wire/codec.py", "import socket\n", "pkg/wire/codec.py:1"),
        ("messages", "pkg/worker/run.py", "import msgpack\n", "pkg/worker/run.py:1"),
        ("messages", "pkg/client/sync.py", "from pickle import loads\n", "pkg/client/sync.py:1"),
        (
            "messages",
            "pkg/worker/run.py",
            "def f(codec, b):\n    return codec.loads(b)\n",
            "pkg/worker/run.py:2",
        ),
        (
            "messages",
            "pkg/ops/cli.py",
            "from pkg.wire.codec import pack_plain\n",
            "pkg/ops/cli.py:1",
        ),
        (
            "boundary",
            "pkg/ops/cli.py",
            "def f(c):\n    return c._broker.meta\n",
            "pkg/ops/cli.py:2",
        ),
        (
            "boundary",
            "pkg/worker/run.py",
            "def f(b):\n    b.redis.get('k')\n",
            "pkg/worker/run.py:2",
        ),
        (
            "dashboard->gateway",
            "pkg/dashboard/app.py",
            "from pkg.gateway.app import TOKEN\n",
            "pkg/dashboard/app.py:1",
        ),
    ],
)
def test_each_rule_names_the_module_and_the_import_that_break_it(
    tmp_path: Path, rule: str, module: str, source: str, named: str
) -> None:
    files = dict(CLEAN)
    files[module] = source + files.get(module, "")
    if rule == "cycles" and module == "pkg/worker/extra.py":
        files["pkg/worker/run.py"] += "from pkg.worker import extra\n"
    problems = layout_problems(write_package(tmp_path, files), "pkg")
    assert problems[rule], f"rule {rule!r} did not fire for {module}: {source!r}"
    assert any(named in p for p in problems[rule]), report(problems[rule])


def test_relative_imports_resolve_against_the_importing_module(tmp_path: Path) -> None:
    root = write_package(
        tmp_path,
        {
            "pkg/worker/pipeline/step.py": "from ...client import sync\nfrom .. import run\n",
            "pkg/worker/run.py": "",
            "pkg/client/sync.py": "",
        },
    )
    modules = module_files(root, "pkg")
    targets = [
        i.target
        for i in imports_of(
            root, "pkg.worker.pipeline.step", modules["pkg.worker.pipeline.step"], modules
        )
    ]
    assert targets == ["pkg.client.sync", "pkg.worker.run"]


# --- queueserve itself -------------------------------------------------------------------

PROBLEMS = layout_problems(REPO, "queueserve")


def test_the_checker_sees_every_module_of_queueserve() -> None:
    modules = module_files(REPO, "queueserve")
    for expected in (
        "queueserve",
        "queueserve.broker.producer",
        "queueserve.wire.protocol",
        "queueserve.worker.pipeline.runner",
        "queueserve.client.sync",
        "queueserve.ops.cli",
    ):
        assert expected in modules


@pytest.mark.parametrize("rule", sorted(PROBLEMS))
def test_queueserve_keeps_the_layout_rule(rule: str) -> None:
    assert not PROBLEMS[rule], report(PROBLEMS[rule])


def test_every_public_name_is_exported_from_the_package() -> None:
    qs = importlib.import_module("queueserve")
    exported = qs.__all__
    assert isinstance(exported, list | tuple) and exported, "queueserve.__all__ is missing"
    duplicates = sorted({n for n in exported if exported.count(n) > 1})
    assert not duplicates, f"names listed twice in queueserve.__all__: {duplicates}"
    missing = [n for n in exported if not hasattr(qs, n)]
    assert not missing, f"queueserve.__all__ names what queueserve does not define: {missing}"
    namespace: dict[str, object] = {}
    exec("from queueserve import *", namespace)
    assert set(exported) <= set(namespace)


MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 300
_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def code_lines(source: str, tree: ast.Module) -> set[int]:
    """The lines of ``source`` that hold code: not blank, not a comment alone, not part of a
    docstring (a module's, a class's or a function's)."""
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.difference_update(range(first.lineno, (first.end_lineno or 0) + 1))
    return lines


def _bound_names(root: Path, name: str, path: Path, tree: ast.Module) -> dict[str, str]:
    """What each name a module imports stands for: ``module`` or ``module.Name``."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _from_base(node, here, str(path.relative_to(root)))
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
    return bound


def _base_name(base: ast.expr, module: str, bound: dict[str, str]) -> str:
    """The qualified name a class statement's base stands for (``Base``, ``mod.Base``,
    ``Base[T]``), as ``class_sizes`` names classes."""
    while isinstance(base, ast.Subscript):  # Generic[T], Base[int]
        base = base.value
    if isinstance(base, ast.Name):
        return bound.get(base.id, f"{module}.{base.id}")
    if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
        return f"{bound.get(base.value.id, base.value.id)}.{base.attr}"
    return ast.unparse(base)


def class_sizes(root: Path, package: str) -> dict[str, tuple[int, int]]:
    """Each class of ``package`` ("module.Class"): its own code lines (``code_lines``), and
    those with every class of the package it inherits from, each counted once: a class kept
    short by stacking bases is as big as the stack."""
    own: dict[str, int] = {}
    bases: dict[str, list[str]] = {}
    for name, path in module_files(root, package).items():
        source = path.read_text()
        tree = ast.parse(source, filename=str(path))
        code = code_lines(source, tree)
        bound = _bound_names(root, name, path, tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            qualified = f"{name}.{node.name}"
            own[qualified] = sum(1 for line in code if node.lineno <= line <= node.end_lineno)
            bases[qualified] = [_base_name(base, name, bound) for base in node.bases]

    def ancestry(cls: str, seen: set[str]) -> None:
        for base in bases.get(cls, []):
            if base in own and base not in seen:
                seen.add(base)
                ancestry(base, seen)

    sizes = {}
    for cls, lines in own.items():
        seen: set[str] = set()
        ancestry(cls, seen)
        sizes[cls] = (lines, lines + sum(own[b] for b in seen - {cls}))
    return sizes


def size_problems(root: Path, package: str) -> list[str]:
    """Modules over MAX_MODULE_LINES lines (as ruff format lays them out), and classes over
    MAX_CLASS_LINES code lines counting their in-package bases."""
    too_big = []
    for path in sorted((root / package).rglob("*.py")):
        if (lines := path.read_text().count("\n")) > MAX_MODULE_LINES:
            too_big.append(f"{path.relative_to(root)}: {lines} lines")
    for cls, (lines, total) in sorted(class_sizes(root, package).items()):
        if total > MAX_CLASS_LINES:
            bases = f" ({lines} of its own, the rest its bases')" if total > lines else ""
            too_big.append(f"class {cls}: {total} code lines{bases}")
    return too_big


def _methods(n: int) -> str:
    return "".join(f"    def f{i}(self):\n        return {i}\n" for i in range(n))


def test_the_size_rule_counts_a_class_with_its_bases_and_measures_code(tmp_path: Path) -> None:
    # Given a class of 201 code lines, a subclass of 151 in another module (a chain, each link
    # under the limit), a class that holds the first instead, and a class of 201 code lines
    # with 200 lines of docstrings and comments (402 lines from top to bottom); and a module
    # of 451 lines
    wordy = '    """' + "words\n" * 100 + '    """\n' + "    # why\n" * 100 + _methods(100)
    root = write_package(
        tmp_path,
        {
            "pkg/base.py": "class Base:\n" + _methods(100),
            "pkg/chain.py": "from pkg.base import Base\n\nclass Chained(Base):\n" + _methods(75),
            "pkg/parts.py": "from pkg import base\n\nclass Holder:\n    part = base.Base\n",
            "pkg/alias.py": "from pkg import base\n\nclass Dotted(base.Base):\n" + _methods(75),
            "pkg/wordy.py": "class Wordy:\n" + wordy,
            "pkg/long.py": "x = 1\n" * 451,
        },
    )
    sizes = class_sizes(root, "pkg")

    # Then the subclasses count their base's lines, and docstrings and comments count nothing
    assert sizes["pkg.base.Base"] == (201, 201)
    assert sizes["pkg.chain.Chained"] == (151, 352)
    assert sizes["pkg.alias.Dotted"] == (151, 352)
    assert sizes["pkg.parts.Holder"] == (2, 2)
    assert sizes["pkg.wordy.Wordy"] == (201, 201)
    problems = size_problems(root, "pkg")
    assert [p.split(":")[0] for p in problems] == [
        "pkg/long.py",
        "class pkg.alias.Dotted",
        "class pkg.chain.Chained",
    ]
    assert "151 of its own" in problems[1]


def test_no_module_or_class_of_queueserve_grows_into_a_hub() -> None:
    """Short modules that each own one thing: a module past 450 lines, or a class past 300
    code lines with its in-package bases, is one that every next feature would have to edit
    (a class is not kept short by stacking bases: its parts are held, not inherited)."""
    too_big = size_problems(REPO, "queueserve")
    assert not too_big, "split these: " + "; ".join(too_big)
