"""Starting and stopping the systems ``python -m bench.embed_peers`` measures, each in its turn.

queueserve: a private redis-server, one ``queueserve worker`` of one partition with
``--torch-threads 1`` serving bench/embed_peers_servings.py, and one ``queueserve gateway``.
The peers: a server from their own venv, ``.venv-embed/<peer>`` (scripts/bench-embed-peers
makes them). Every server process gets the same environment: one OpenMP/MKL thread, Hugging
Face offline. A server is ready when it answers an embeddings request (its model loaded); it
is stopped with everything it started (Ray's raylet and workers included).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._harness import REPO_ROOT, RedisServer, free_port, process_tree
from .embed_peers_load import ClientDoor, HttpDoor
from .embed_peers_servings import BATCH, WAIT_S

VENVS = REPO_ROOT / ".venv-embed"
MODEL_NAME = "all-MiniLM-L6-v2"  # the gateway's alias of the embed serving; Infinity's name
PREFIX = "qsembedpeers"
READY_S = 300.0  # Ray on a busy 2-core machine takes a minute or more to serve
ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",  # Infinity's usage statistics
    "INFINITY_ANONYMOUS_USAGE_STATS": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray starts its workers (the replica holding the model) at nice 15; on a machine shared
    # with other work that would measure the niceness, not Ray Serve.
    "RAY_worker_niceness": "0",
    "PYTHONUNBUFFERED": "1",
}
DISTRIBUTIONS = {"infinity": "infinity-emb", "litserve": "litserve", "ray": "ray"}


def stack_of(key: str) -> tuple[str, ...]:
    """The systems one start serves: queueserve's client and gateway share a worker."""
    return ("qs-client", "qs-gateway") if key in ("qs-client", "qs-gateway") else (key,)


def python_of(key: str) -> Path:
    return VENVS / key / "bin" / "python"


def missing(key: str) -> str:
    """Why a peer cannot run here ("" when it can)."""
    if key.startswith("qs-"):
        return ""
    if not python_of(key).exists():
        return (
            f"{python_of(key).relative_to(REPO_ROOT)} does not exist: run scripts/bench-embed-"
            f"peers (it installs bench/embed-peers-{key}-requirements.txt there)"
        )
    return ""


def version(key: str) -> str:
    """The version of the system measured (its venv's, for a peer)."""
    if key.startswith("qs-"):
        from importlib import metadata

        return metadata.version("queueserve")
    code = f"from importlib.metadata import version; print(version({DISTRIBUTIONS[key]!r}))"
    out = subprocess.run(
        [str(python_of(key)), "-c", code], capture_output=True, text=True, check=False
    )
    return out.stdout.strip()


def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """A server in a session of its own, its output into ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env={**os.environ, **ENV},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM to the server's session, then SIGKILL to whatever of its tree is left."""
    tree = process_tree(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    for pid in [*tree, *process_tree(proc.pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def answers(port: int) -> bool:
    """Whether the server answers an embeddings request; a 4xx other than 404 (a route not
    mounted yet) means the request itself is wrong: no use waiting."""
    body = f'{{"model": "{MODEL_NAME}", "input": "ready?"}}'.encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/embeddings",
        data=body,
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return bool(response.status == 200)
    except urllib.error.HTTPError as e:
        if 400 <= e.code < 500 and e.code != 404:
            raise RuntimeError(f"POST /v1/embeddings answered {e.code}: {e.read()[:300]!r}") from e
        return False
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def wait_ready(procs: list[subprocess.Popen[bytes]], port: int, log: Path, what: str) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {proc.returncode}:\n{tail(log)}")
        if answers(port):
            return
        time.sleep(1.0)
    raise RuntimeError(f"{what} did not answer within {READY_S:g} s:\n{tail(log)}")


def tail(log: Path, lines: int = 25) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def peer_argv(key: str, port: int, model: str) -> list[str]:
    if key == "infinity":
        return [
            str(VENVS / "infinity" / "bin" / "infinity_emb"),
            "v2",
            "--model-id",
            model,
            "--served-model-name",
            MODEL_NAME,
            "--batch-size",
            str(BATCH),
            "--engine",
            "torch",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--no-bettertransformer",
            "--no-model-warmup",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--url-prefix",
            "/v1",
            "--log-level",
            "warning",
        ]
    return [
        str(python_of(key)),
        "-m",
        f"bench.embed_peers_runners.{key}_server",
        "--model",
        model,
        "--port",
        str(port),
        "--batch",
        str(BATCH),
        "--wait",
        str(WAIT_S),
        "--threads",
        "1",
    ]


@contextlib.contextmanager
def started(key: str, texts: list[str], args: Any) -> Iterator[dict[str, Any]]:
    """The system ``key`` started and answering: its doors by system key (a door, or for the
    AsyncClient a coroutine function making one in the measuring event loop)."""
    from tasks.embed import model_dir

    logs = Path(tempfile.mkdtemp(prefix="qs-embed-peers-"))
    log = logs / f"{key}.log"
    procs: list[subprocess.Popen[bytes]] = []
    server: RedisServer | None = None
    try:
        port = free_port()
        if key.startswith("qs-"):
            server = RedisServer().start()
            url = server.url
            serving = "embed_nowait" if key == "qs-nowait" else "embed"
            procs.append(spawn(queueserve_argv(url, "worker", serving), log))
            # (the gateway answering is what says the worker serves; qs-nowait's is not measured)
            procs.append(spawn(queueserve_argv(url, "gateway", "--port", str(port)), log))
            wait_ready(procs, port, log, "the queueserve worker and gateway")
            if key == "qs-nowait":
                yield {key: lambda: client_door(url, texts, key, serving)}
            else:
                yield {
                    "qs-client": lambda: client_door(url, texts, "qs-client", serving),
                    "qs-gateway": HttpDoor("qs-gateway", port, texts, MODEL_NAME),
                }
        else:
            procs.append(spawn(peer_argv(key, port, str(model_dir())), log))
            wait_ready(procs, port, log, key)
            yield {key: HttpDoor(key, port, texts, MODEL_NAME)}
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{key}: a server exited during the run:\n{tail(log)}")
    finally:
        for proc in reversed(procs):
            stop(proc)
        if server is not None:
            server.stop()
        shutil.rmtree(logs, ignore_errors=True)  # a failure's tail is in its error already


def queueserve_argv(url: str, command: str, *more: str) -> list[str]:
    """``queueserve worker SERVING`` (a serving of bench/embed_peers_servings.py; one
    partition, one torch thread) or ``queueserve gateway ...``."""
    if command == "worker":
        serving = f"bench.embed_peers_servings:{more[0]}"
        more = (serving, "--partitions", "1", "--torch-threads", "1")
    common = ("--redis-url", url, "--prefix", PREFIX, "--log-level", "warning")
    return [sys.executable, "-m", "queueserve", command, *more, *common]


async def client_door(url: str, texts: list[str], key: str, serving: str) -> ClientDoor:
    import queueserve as qs

    from . import embed_peers_servings

    embed = getattr(embed_peers_servings, serving)
    return ClientDoor(key, qs.AsyncClient(url, prefix=PREFIX), embed, texts)
