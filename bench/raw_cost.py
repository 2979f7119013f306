"""CPU per round trip of the ways queueserve can send commands: redis-py's pipeline, a single
redis-py command, and ``queueserve.broker.raw`` (docs/benchmarks.md, "Second pass").

    python -m bench.raw_cost [--calls 5000] [--rounds 3]

Each way sends two small commands (PING, PEXPIRE) and reads both replies, ``--calls`` times,
on a private redis-server; the ways alternate, ``--rounds`` times, so a busy machine moves all
of them alike. Printed: CPU µs of this process per round trip, each round.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import redis

from bench._harness import RedisServer
from queueserve.broker import raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    server = RedisServer().start()
    client = redis.Redis.from_url(server.url)
    connections = raw.Connections(client.connection_pool)
    key = "raw-cost"

    def pipeline() -> None:
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("PING")
        pipe.execute_command("PEXPIRE", key, 1000)
        pipe.execute()

    def single_commands() -> None:
        client.execute_command("PING")
        client.execute_command("PEXPIRE", key, 1000)

    def raw_run() -> None:
        raw.run(connections, [("PING",), ("PEXPIRE", key, 1000)])

    ways: dict[str, Callable[[], None]] = {
        "redis-py pipeline": pipeline,
        "redis-py, two commands": single_commands,
        "queueserve.broker.raw": raw_run,
    }
    try:
        for way in ways.values():
            way()
        for r in range(args.rounds):
            cells = []
            for name, way in ways.items():
                start = time.process_time()
                for _ in range(args.calls):
                    way()
                cells.append(f"{name} {(time.process_time() - start) / args.calls * 1e6:6.1f}")
            print(f"round {r + 1}: CPU µs per round trip: " + ", ".join(cells))
    finally:
        connections.close()
        client.close()
        server.stop()


if __name__ == "__main__":
    main()
