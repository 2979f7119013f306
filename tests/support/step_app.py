"""Step servings for the continuous-batching tests (issue 14), importable by worker processes
as ``tests.support.step_app:NAME``.

``Count`` is deterministic: an item ``{"n": N, "base": B}`` yields ``B, B+1, ..., B+N-1`` (its
expected outputs are ``expected(item)``), so any interleaving with other requests must give
the same answer. Flags make one item misbehave: ``hold`` keeps it going until the serving's
``gate`` opens, ``fail_decode`` raises in the decode step that reaches output number K,
``fail_prefill`` raises in prefill, ``fail_tokens`` in tokens(), ``list_tokens`` makes
prompt_tokens() return unhashable tokens, and ``budget`` is what tokens() says it may
generate. ``prompt`` adds a prompt whose state (a rolling hash) is computed one token at a
time, resumable from the prefix cache, and mixed into the outputs. ``Sampled`` is not
deterministic: each run of a request says something else (a sampling decoder);
``SampledBatch`` is the same as a generator batch serving.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis

import queueserve as qs
from queueserve.worker.middleware import Middleware
from queueserve.worker.stepping.joins import StepRecord

HOLD_STEP_S = 0.002  # a held sequence's step: keeps a gated test from flooding Redis
MOD = 1_000_003


def prompt_hash(prompt: str, start: int = 0, h: int = 0) -> int:
    for ch in prompt[start:]:
        h = (h * 131 + ord(ch)) % MOD
    return h


def expected(item: dict[str, Any]) -> list[int]:
    """What ``Count`` outputs for ``item``, run alone."""
    mix = prompt_hash(item.get("prompt", ""))
    return [(item.get("base", 0) + i + mix) % MOD for i in range(item["n"])]


class Count(qs.StepServing):
    name = "count"
    max_slots = 4
    max_batch_tokens = 10_000
    max_prefill_tokens = 1_000
    prefix_cache_bytes = 4096

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.gate = threading.Event()  # start_worker's teardown sets it
        # Prompt tokens computed (not resumed from the cache); a list, so the worker's copy of
        # the serving counts into the test's.
        self.prefilled_tokens = [0]
        self._lock = threading.Lock()

    def tokens(self, item: dict[str, Any]) -> tuple[int, int]:
        if item.get("fail_tokens"):
            raise KeyError("no tokenizer entry for this item")
        return len(item.get("prompt", "")), item.get("budget", item["n"])

    def prompt_tokens(self, item: dict[str, Any]) -> list[Any] | None:
        if item.get("list_tokens"):  # a serving's bug: lists cannot key the prefix cache
            return [[ch] for ch in item["prompt"]]
        return list(item["prompt"]) if item.get("prompt") else None

    def prefill(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.prefill_from(items, [qs.Resume(()) for _ in items])

    def prefill_from(
        self, items: list[dict[str, Any]], resumes: list[qs.Resume]
    ) -> list[dict[str, Any]]:
        if any(item.get("fail_prefill") for item in items):
            raise ValueError("prefill refused an item marked fail_prefill")
        states = []
        for item, resume in zip(items, resumes, strict=True):
            prompt = item.get("prompt", "")
            h = resume.state if resume.start else 0
            for pos in range(resume.start, len(prompt)):
                h = prompt_hash(prompt[pos], 0, h)
                if (pos + 1) % 4 == 0:  # offer every 4th prefix to the cache
                    resume.keep(pos + 1, h, 8)
            with self._lock:
                self.prefilled_tokens[0] += len(prompt) - resume.start
            states.append({"item": item, "i": 0, "mix": h})
        return states

    def decode(self, states: list[dict[str, Any]]) -> list[Any]:
        for s in states:  # compute first, change states after: isolation may re-run a step
            if s["item"].get("fail_decode") == s["i"]:
                raise RuntimeError(f"decode failed at output {s['i']} of {s['item']}")
        if any(s["item"].get("hold") for s in states):
            time.sleep(HOLD_STEP_S)
        out: list[Any] = []
        for s in states:
            item = s["item"]
            going = s["i"] < item["n"] or (item.get("hold") and not self.gate.is_set())
            out.append((item.get("base", 0) + s["i"] + s["mix"]) % MOD if going else qs.END)
            s["i"] += 1
        return out


class Records(Middleware):
    """Every StepRecord of the worker it is given to, in order."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self._lock = threading.Lock()

    def step(self, serving: qs.Serving, partition: qs.Partition, record: StepRecord) -> None:
        with self._lock:
            self.records.append(record)

    def snapshot(self) -> list[StepRecord]:
        with self._lock:
            return list(self.records)


class Paced(Count):
    """For the SIGKILL test in worker processes: each step takes a little real time (so the kill
    lands mid-generation) and records the pid that ran it in the test's Redis."""

    name = "paced"
    step_s = 0.02

    def decode(self, states: list[dict[str, Any]]) -> list[Any]:
        r = redis.Redis.from_url(os.environ["QS_TEST_URL"], socket_timeout=5.0)
        r.set(f"{os.environ['QS_TEST_PREFIX']}:steps:pid", os.getpid())
        r.close()
        time.sleep(self.step_s)
        return super().decode(states)


paced = Paced()


class Sampled(Paced):
    """Paced, and sampling: each run of a request draws a seed of its own (as a decoder that
    samples with a generator the request does not seed), and every output names the run that
    made it, ``"<seed>:<step>"``: two runs of one request never agree."""

    name = "sampled"

    def prefill_from(
        self, items: list[dict[str, Any]], resumes: list[qs.Resume]
    ) -> list[dict[str, Any]]:
        states = super().prefill_from(items, resumes)
        for state in states:
            state["seed"] = secrets.randbits(32)
        return states

    def decode(self, states: list[dict[str, Any]]) -> list[Any]:
        out = super().decode(states)  # each state's "i" is now one past this step's
        return [
            o if o is qs.END else f"{s['seed']}:{s['i'] - 1}"
            for s, o in zip(states, out, strict=True)
        ]


class SampledResult(Sampled):
    """Sampled with an answer of its own (a final Output, not the steps): the run's seed and
    its outputs."""

    name = "sampled-result"

    def result(self, state: dict[str, Any], outputs: list[Any]) -> Any:
        return {"seed": state["seed"], "outputs": outputs}


class SampledBatch(qs.Serving):
    """A generator *batch* serving that samples like ``Sampled``: item ``{"n": N}`` yields
    ``"<seed>:<step>"`` for N paced steps, a seed drawn per run; records its pid as Paced."""

    name = "sampled-batch"
    batch_size = 4
    batch_timeout = 0.0

    def handle_batch(self, batch: qs.Batch) -> Iterator[list[Any]]:
        seeds = [secrets.randbits(32) for _ in batch]
        r = redis.Redis.from_url(os.environ["QS_TEST_URL"], socket_timeout=5.0)
        try:
            for k in range(max(item["n"] for item in batch)):
                r.set(f"{os.environ['QS_TEST_PREFIX']}:steps:pid", os.getpid())
                time.sleep(Paced.step_s)
                yield [
                    f"{seed}:{k}" if k < item["n"] else qs.END
                    for seed, item in zip(seeds, batch, strict=True)
                ]
        finally:
            r.close()


sampled = Sampled()
sampled_result = SampledResult()
sampled_batch = SampledBatch()
