"""Real multi-node Redis topologies for the scale-out tests, on free loopback ports, torn down
after: a Redis Cluster (3 masters, 3 replicas, made with ``redis-cli --cluster create``) and a
Sentinel set (1 master, 2 replicas, 3 sentinels, run as ``redis-server --sentinel``).

Each node is a :class:`RedisServer` of its own (its own directory and log), so a test can kill one
(``kill()``) to force a failover and read its log when something goes wrong.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.cluster import ClusterNode

from tests.support.redis_server import (
    RedisServer,
    free_port,
    redis_server_binary,
    start_redis_server,
)

FORM_TIMEOUT_S = 30.0
MAX_CLUSTER_PORT = 55535  # a node also listens on port + 10000 (its cluster bus)


def cluster_port() -> int:
    """A free port a cluster node may use: at most 55535, its bus port (+10000) free too. The
    kernel's ephemeral range here reaches 60999, so free_port() alone often picks one too high.
    """
    for _ in range(1000):
        port = random.randrange(20000, MAX_CLUSTER_PORT)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) below 55535 for a cluster node")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait(condition: object, what: str, timeout: float = FORM_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():  # type: ignore[operator]
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout:g}s for {what}")
        time.sleep(0.05)


@dataclass
class Cluster:
    """A running local cluster; ``url`` names one master (redis-py discovers the rest)."""

    nodes: list[RedisServer]
    masters: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def client(self) -> redis.RedisCluster:
        """A cluster client seeded with every running node (a test may have killed node 0)."""
        return redis.RedisCluster(
            startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in self.nodes if n.running]
        )

    def node_of_slot(self, slot: int) -> RedisServer:
        """The node serving ``slot`` as master now (after failovers too)."""
        with self.client() as rc:
            node = rc.nodes_manager.get_node_from_slot(slot)
        return next(n for n in self.nodes if n.port == node.port)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextmanager
def redis_cluster(
    directory: Path, masters: int = 3, replicas_per_master: int = 1
) -> Iterator[Cluster]:
    """Start ``masters`` x (1 + ``replicas_per_master``) cluster-enabled servers and join them."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise RuntimeError(
            "redis-cli not found: install Debian's redis-tools (apt-get install -y "
            "redis-server brings it)"
        )
    count = masters * (1 + replicas_per_master)
    nodes: list[RedisServer] = []
    try:
        for i in range(count):
            port = cluster_port()
            nodes.append(
                start_redis_server(
                    directory / f"node{i}",
                    port=port,
                    extra_args=(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        f"nodes-{port}.conf",
                        "--cluster-node-timeout",
                        "1000",
                        "--appendonly",
                        "no",
                    ),
                )
            )
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{n.port}" for n in nodes],
                "--cluster-replicas",
                str(replicas_per_master),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        probe = redis.Redis(port=nodes[0].port)
        _wait(lambda: probe.cluster("info")["cluster_state"] == "ok", "cluster_state:ok")
        probe.close()
        cluster = Cluster(nodes)
        cluster.masters = [n for n in nodes if _role(n) == "master"]
        for master in cluster.masters:  # replicas synced: WAIT (durable enqueue) can succeed
            _wait(
                lambda m=master: _synced_replicas(m) == replicas_per_master,
                f"the replicas of {master.port} to sync",
            )
        yield cluster
    finally:
        for node in nodes:
            node.stop()


def _synced_replicas(node: RedisServer) -> int:
    with redis.Redis(port=node.port) as r:
        info = r.info("replication")
    return sum(
        1
        for k, v in info.items()
        if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
    )


def _role(node: RedisServer) -> str:
    with redis.Redis(port=node.port) as r:
        return str(r.info("replication")["role"])


class Sentinel(RedisServer):
    """A sentinel process: ``redis-server sentinel.conf --sentinel`` (it rewrites its config)."""

    @property
    def conf(self) -> Path:
        return self.dir / "sentinel.conf"

    def command(self) -> list[str]:
        return [
            redis_server_binary(),
            str(self.conf),
            "--sentinel",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.logfile),
        ]


@dataclass
class SentinelSet:
    """A master, its replicas and the sentinels watching them as ``service``."""

    service: str
    master: RedisServer
    replicas: list[RedisServer]
    sentinels: list[Sentinel]

    @property
    def url(self) -> str:
        """``redis+sentinel://`` URL naming every sentinel and the service."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def current_master_port(self) -> int:
        with redis.Redis(port=self.sentinels[0].port) as s:
            _host, port = s.sentinel_get_master_addr_by_name(self.service)
        return int(port)

    def failover(self) -> None:
        """Ask the sentinels to promote a replica (what an operator or a dead master causes)."""
        before = self.current_master_port()
        with redis.Redis(port=self.sentinels[0].port) as s:
            s.execute_command("SENTINEL", "FAILOVER", self.service)
        _wait(lambda: self.current_master_port() != before, "the sentinels to promote a replica")


@contextmanager
def sentinel_set(
    directory: Path, service: str = "qsmaster", replicas: int = 2, sentinels: int = 3
) -> Iterator[SentinelSet]:
    servers: list[RedisServer] = []
    try:
        master = start_redis_server(directory / "master")
        servers.append(master)
        replica_nodes = []
        for i in range(replicas):
            node = start_redis_server(
                directory / f"replica{i}", extra_args=("--replicaof", "127.0.0.1", str(master.port))
            )
            servers.append(node)
            replica_nodes.append(node)
        # replicas online (synced), not only connected: WAIT (durable enqueue) counts only those
        _wait(lambda: _synced_replicas(master) == replicas, "the replicas to sync")
        sentinel_nodes = []
        for i in range(sentinels):
            node = Sentinel(directory / f"sentinel{i}", free_port(), False, ())
            conf = node.conf
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text(
                f"sentinel monitor {service} 127.0.0.1 {master.port} {min(2, sentinels)}\n"
                f"sentinel down-after-milliseconds {service} 1000\n"
                f"sentinel failover-timeout {service} 5000\n"
                f"sentinel parallel-syncs {service} 1\n"
            )
            node.start()
            servers.append(node)
            sentinel_nodes.append(node)
        topology = SentinelSet(service, master, replica_nodes, sentinel_nodes)
        with redis.Redis(port=sentinel_nodes[0].port) as s:
            _wait(
                lambda: len(s.sentinel_sentinels(service)) == sentinels - 1,
                "the sentinels to find each other",
            )
        yield topology
    finally:
        for server in servers:
            server.stop()
