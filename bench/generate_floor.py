"""What the generation path costs without the model: the ceiling continuous batching can reach.

    python -m bench.generate_floor [--repeat 2]

One worker process (one partition) serves charlm statically and continuously (prefix cache
off), and the same two with a *null model*: the same schedules, steps and outputs' lengths,
the same Python in ``decode``, but a GRU cell that returns its state unchanged and logits of
zeros (no arithmetic). bench/generate.py's saturating load goes to each in turn,
``--repeat`` times. Printed per run: characters per second and the CPU seconds of the worker
process, redis-server and this process (the 160 streaming callers).

With no model, what is left is the work per character that both schedules share (an event per
character per caller: composed and published by the worker, passed on by Redis, received by
the caller) and each executor's own per-step work. Continuous batching cannot go past its
null-model rate, whatever its model costs; so the null rates against static's real rate bound
the gain continuous batching can show end to end on this machine.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

import queueserve as qs
from bench.generate import charlm_worker, run_load, summarize, workload
from tasks.charlm import CharLM, StaticCharLM


class NullStepper:
    """No arithmetic: a cell that keeps the state, logits of zeros (character 0 each step)."""

    hidden = 384

    def cell(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.zeros(h.shape[0], 96)


class NullLM(CharLM):
    def setup(self, partition: qs.Partition) -> None:
        super().setup(partition)
        self.stepper = NullStepper()  # type: ignore[assignment]


class NullStatic(StaticCharLM):
    name = "null_static"

    def setup(self, partition: qs.Partition) -> None:
        self.lm = NullLM(prompt_chunk=CharLM.max_prefill_tokens)
        self.lm.setup(partition)


charlm_cold = CharLM(name="charlm_cold", prefix_cache_bytes=0)
null_cold = NullLM(name="null_cold", prefix_cache_bytes=0)
null_static = NullStatic()
SERVINGS = {
    "charlm_static": "tasks.charlm:charlm_static",
    "charlm_cold": "bench.generate_floor:charlm_cold",
    "null_static": "bench.generate_floor:null_static",
    "null_cold": "bench.generate_floor:null_cold",
}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children that ran so far (live ones too)."""
    total = 0.0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            with open(f"/proc/{p}/task/{p}/children") as f:
                pids += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    load = workload(160, 300.0, 1)  # bench/generate.py's saturating load
    with charlm_worker(list(SERVINGS.values()), list(SERVINGS)) as (client, worker, server):
        assert server.proc is not None
        for _ in range(args.repeat):
            print(f"load average {os.getloadavg()[0]:.2f}")
            for serving in SERVINGS:
                before: list[Any] = [
                    cpu_seconds(worker.pid),
                    cpu_seconds(server.proc.pid),
                    time.process_time(),
                ]
                summarize(serving[:11], *run_load(client, serving, load))
                print(
                    f"{'':11} CPU s: worker {cpu_seconds(worker.pid) - before[0]:.2f}, redis "
                    f"{cpu_seconds(server.proc.pid) - before[1]:.2f}, callers "
                    f"{time.process_time() - before[2]:.2f}"
                )


if __name__ == "__main__":
    main()
