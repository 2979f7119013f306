"""Options declared once (queueserve/options/, queueserve/worker/options.py): the same checks
whichever way a value comes (keyword, flag, QUEUESERVE_* variable, text read from Redis), and
the flags, their help and docs/operations.md built from or held to the model."""

from __future__ import annotations

import ast
import inspect
import re
from typing import Any

import pytest

import queueserve as qs
from queueserve.ops.cli import build_parser
from queueserve.ops.server_flags import flag_of
from queueserve.options.servers import SERVERS, DashboardOptions, GatewayOptions
from queueserve.options.serving_options import ServingOptions, StepOptions
from queueserve.options.units import parse_bytes
from queueserve.worker.options import OTHER_VARIABLES, WorkerOptions, unknown_variables
from tests.support.helpers import REPO
from tests.unit.test_layout import (
    import_graph,
    imports_of,
    module_files,
    shortest_chain,
    show,
    within,
)


def square(xs: list[int]) -> list[int]:
    return [x * x for x in xs]


def test_a_variable_sets_a_worker_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUEUESERVE_BATCH_SIZE", "64")
    monkeypatch.setenv("QUEUESERVE_MAX_PARTITION_MEMORY", "4GiB")
    monkeypatch.setenv("QUEUESERVE_BATCH_KEYS", "a,b")
    worker = qs.Worker([qs.Serving(square, batch_size=4)])
    assert worker.servings[0].batch_size == 64
    assert worker.config.limits.max_partition_memory == 4 * 2**30
    assert worker.options.batch_keys == ("a", "b")


def test_a_keyword_or_flag_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUEUESERVE_BATCH_SIZE", "64")
    assert qs.Worker([qs.Serving(square)], batch_size=8).servings[0].batch_size == 8
    args = build_parser().parse_args(["worker", "m:a", "--batch-size", "8"])
    flags = {n: getattr(args, n) for n in WorkerOptions.model_fields if hasattr(args, n)}
    assert WorkerOptions.of(flags).batch_size == 8
    assert WorkerOptions.of({}).batch_size == 64


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        (
            "QUEUESERVE_BATCH_SIZE",
            "0",
            "QUEUESERVE_BATCH_SIZE='0': batch_size must be an int from 1",
        ),
        ("QUEUESERVE_BATCH_SIZE", "lots", "batch_size must be an integer, got 'lots'"),
        ("QUEUESERVE_SHUTDOWN_TIMEOUT", "soon", "'soon' is not a duration; write it like '10ms'"),
        ("QUEUESERVE_MAX_PARTITION_MEMORY", "inf", "a number of bytes like 2GiB"),
        ("QUEUESERVE_PARTITIONS", "two", "partitions must be 'auto' or an int >= 1"),
    ],
)
def test_a_bad_variable_says_which_and_what_was_wrong(variable: str, value: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        WorkerOptions.of({}, {variable: value})


def test_a_misspelled_variable_is_named_with_the_one_meant() -> None:
    misspelled, unknown = unknown_variables(
        {
            "QUEUESERVE_BATCH_SIZ": "64",
            "QUEUESERVE_REDIS_URL": "redis://x",
            "QUEUESERVE_ZZZ": "1",
            "PATH": "/bin",
        }
    )
    assert len(misspelled) == 1 and "did you mean QUEUESERVE_BATCH_SIZE?" in misspelled[0]
    assert unknown == ["QUEUESERVE_ZZZ"]


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_concurrent_batches", True),
        ("max_concurrent_batches", 0),
        ("metrics_keys", -1),
        ("metrics_keys", 2.0),
        ("max_batches_per_partition", False),
        ("max_restarts", "5"),
    ],
)
def test_worker_ints_are_strict(option: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"{option} must be an int"):
        qs.Worker([qs.Serving(square)], **{option: value})


def test_an_unknown_option_is_an_error() -> None:
    with pytest.raises(ValueError, match="'batch_siz' is not an option"):
        WorkerOptions.of({"batch_siz": 4})
    with pytest.raises(SystemExit):  # argparse: "unrecognized arguments", abbreviations too
        build_parser().parse_args(["worker", "m:a", "--batch-siz", "8"])


def test_every_worker_option_is_a_flag_and_a_documented_variable() -> None:
    parser = build_parser()
    worker = parser._subparsers._group_actions[0].choices["worker"]  # type: ignore[union-attr]
    flags = {a.dest for a in worker._actions}
    operations = (REPO / "docs" / "operations.md").read_text()
    for name in WorkerOptions.model_fields:
        assert name in flags, name
        assert f"`QUEUESERVE_{name.upper()}`" in operations, name


@pytest.mark.parametrize("command", sorted(SERVERS))
def test_every_server_option_is_a_flag_and_a_documented_variable(command: str) -> None:
    """The servers' options (options/servers.py) are their flags, their variables and the rows
    of docs/operations.md's table: one list, three views."""
    model = SERVERS[command]
    parser = build_parser()
    server = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    flags = {a.dest: a.option_strings for a in server._actions}
    operations = (REPO / "docs" / "operations.md").read_text()
    for name in model.model_fields:
        assert name in flags, name
        row = f"| `{model.variable(name)}` | `{command} {flag_of(name)}`"
        assert row in operations, row
        assert model.variable(name) in OTHER_VARIABLES  # known: no "did you mean" for it
    assert set(flags) - set(model.model_fields) <= {"help", "redis_url", "prefix"}


@pytest.mark.parametrize(
    ("given", "environ", "want"),
    [
        ({}, {}, {"port": 8000, "keep_alive_timeout": 75.0, "log_level": "INFO"}),
        (
            {},
            {"QUEUESERVE_GATEWAY_PORT": "9", "QUEUESERVE_GATEWAY_LOG_LEVEL": "debug"},
            {"port": 9, "log_level": "DEBUG"},
        ),
        ({"port": 7}, {"QUEUESERVE_GATEWAY_PORT": "9"}, {"port": 7}),  # the flag wins
        (
            {},
            {
                "QUEUESERVE_GATEWAY_MODELS": "gpt=embed,x=y",
                "QUEUESERVE_GATEWAY_ALLOW_ORIGIN": " https://a.example ,*",
            },
            {"models": ("gpt=embed", "x=y"), "allow_origin": ("https://a.example", "*")},
        ),
        ({}, {"QUEUESERVE_DASHBOARD_PORT": "9"}, {"port": 8000}),  # another server's variable
    ],
)
def test_a_server_option_is_its_flag_else_its_variable_else_its_default(
    given: dict[str, Any], environ: dict[str, str], want: dict[str, Any]
) -> None:
    options = GatewayOptions.of(given, environ)
    assert {k: getattr(options, k) for k in want} == want


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        ({"QUEUESERVE_GATEWAY_HEADER_TIMEOUT": "soon"}, "QUEUESERVE_GATEWAY_HEADER_TIMEOUT='soon'"),
        ({"QUEUESERVE_GATEWAY_PORT": "70000"}, "port must be an int from 0 to 65535"),
        ({"QUEUESERVE_GATEWAY_ALLOW_ORIGIN": "evil.example"}, "is not one: write it as"),
        ({"QUEUESERVE_GATEWAY_LOG_LEVEL": "LOUD"}, "log_level must be DEBUG"),
        ({"QUEUESERVE_GATEWAY_MAX_CONNECTIONS": "0"}, "max_connections must be an int >= 1"),
    ],
)
def test_a_bad_server_variable_says_which_and_what_was_wrong(
    environ: dict[str, str], says: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        GatewayOptions.of({}, environ)
    dashboard = {k.replace("GATEWAY", "DASHBOARD"): v for k, v in environ.items()}
    with pytest.raises(ValueError, match=re.escape(says.replace("GATEWAY", "DASHBOARD"))):
        DashboardOptions.of({}, dashboard)
    assert DashboardOptions.of({}, environ) == DashboardOptions.of({}, {})  # not its own


def test_byte_sizes_have_one_parser() -> None:
    assert parse_bytes("4GiB", "x") == 4 * 2**30
    assert parse_bytes("512MB", "x") == 512 * 10**6
    assert parse_bytes(1024, "x") == 1024
    for bad in (True, "0", 0, "1e400GiB"):
        with pytest.raises(ValueError, match="x must be"):
            parse_bytes(bad, "x")


def test_every_worker_option_is_a_worker_keyword() -> None:
    keywords = inspect.signature(qs.Worker).parameters
    assert set(WorkerOptions.model_fields) <= set(keywords)


def test_the_serving_keywords_and_attributes_are_its_options() -> None:
    """qs.Serving's keywords and typed attributes name ServingOptions' fields and nothing
    else but its batch function's parts; qs.StepServing's add StepOptions' (the keyword list
    stays written out, for static checks and help(), so this holds it to the options)."""
    not_options = {"self", "fn", "name", "prepare", "finish", "cost", "batch_key", "input_model"}
    keywords = set(inspect.signature(qs.Serving.__init__).parameters) - not_options
    assert keywords == set(ServingOptions.model_fields)
    typed = set(qs.Serving.__annotations__) - {"name", "cost", "batch_key", "input_model"}
    assert typed == set(ServingOptions.model_fields)
    step = set(inspect.signature(qs.StepServing.__init__).parameters) - {"self", "options"}
    assert step == set(StepOptions.model_fields) == set(qs.StepServing.__annotations__)


def test_the_options_package_does_no_io() -> None:
    """queueserve/options/ is imported by wire/ and by servings: it reaches nothing that does
    I/O (and no worker or client code)."""
    modules = module_files(REPO, "queueserve")
    imports = [i for name, path in modules.items() for i in imports_of(REPO, name, path, modules)]
    graph = import_graph(imports, modules)
    forbidden = [f"queueserve.{p}" for p in ("broker", "client", "worker", "ops")] + ["redis"]
    for module in (m for m in modules if within(m, "queueserve.options")):
        chain = shortest_chain(graph, module, lambda m: any(within(m, f) for f in forbidden))
        assert chain is None, show(chain)


@pytest.mark.parametrize(
    "path",
    [
        "options/units.py",
        "options/serving_options.py",
        "serving.py",
        "steps.py",
        "worker/options.py",
        "worker/worker.py",
        "options/stored.py",
        "ops/cli.py",
        "settings.py",
    ],
)
def test_option_modules_and_classes_stay_small(path: str) -> None:
    source = (REPO / "queueserve" / path).read_text()
    assert source.count("\n") <= 450, path
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            assert node.end_lineno is not None
            assert node.end_lineno - node.lineno < 300, f"{path}: class {node.name}"
