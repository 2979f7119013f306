"""Servings with a state per batch key (``load_key``), for the tests of many models behind one
serving: ``Keyed`` runs in a test's own worker and remembers what it loaded and unloaded;
``keyed`` (``tests.support.key_app:keyed``) runs in worker processes and records into the
test's Redis, as tests/support/fault_app.py's servings do."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import queueserve as qs
from tests.support.fault_app import _Recorded, wait_for_key

GATE_LIMIT_S = 30.0


@dataclass(eq=False)
class Model:
    """A key's state: which key, which load of it, and whether it was unloaded since."""

    key: str
    load: int
    bytes: int = 0
    unloaded: bool = field(default=False)


class Keyed(qs.Serving):
    """Answers ``<key>:<item>`` from its key's state, checking the state is its batch's key's
    and still loaded. Remembers loads, unloads and the states held at once (``live``; the
    most of them, and of their bytes, in ``most``). ``fail``: key -> loads of it that raise first.
    ``hold``: items whose batch waits in the executor until ``release()``."""

    def __init__(
        self,
        *,
        fail: dict[str, int] | None = None,
        hold: Iterable[Any] = (),
        state_size: int = 0,
        load_s: float = 0.0,
        work_s: float = 0.0,
        **options: Any,
    ) -> None:
        options.setdefault("name", "keyed")
        super().__init__(**options)
        self.fail = dict(fail or {})
        self.hold = set(hold)
        self.state_size = state_size
        self.load_s = load_s
        self.work_s = work_s
        self.order: list[str] = []  # the key of each batch run, in order
        self.lock = threading.Lock()
        self.loads: list[str] = []
        self.unloads: list[Model] = []
        self.failed: list[str] = []  # loads that raised
        self.live: list[Model] = []
        # (the worker runs a copy of the serving: what it counts lives in shared objects)
        self.most = {"live": 0, "bytes": 0}
        self.loading: list[str] = []  # keys whose load_key runs now
        self.most_loading = [0]  # the most loads that ran at once
        self.running: list[str] = []  # keys of the batches in handle_batch now
        self.problems: list[str] = []
        self.gate = threading.Event()
        self._count = itertools.count(1)

    def release(self) -> None:
        self.gate.set()

    def load_key(self, key: str) -> Model:
        with self.lock:
            self.loads.append(key)
            if self.fail.get(key, 0) > 0:
                self.fail[key] -= 1
                self.failed.append(key)
                raise FileNotFoundError(f"no model for {key}")
            self.loading.append(key)
            self.most_loading[0] = max(self.most_loading[0], len(self.loading))
        time.sleep(self.load_s)  # a model's weights being read
        with self.lock:
            self.loading.remove(key)
            model = Model(key, next(self._count), self.state_size)
            self.live.append(model)
            self.most["live"] = max(self.most["live"], len(self.live))
            self.most["bytes"] = max(self.most["bytes"], sum(m.bytes for m in self.live))
        return model

    def unload_key(self, key: str, state: Model) -> None:
        with self.lock:
            if state.key != key or state.unloaded or state not in self.live:
                self.problems.append(f"unload_key({key!r}) with {state}")
            if key in self.running:
                self.problems.append(f"{key} unloaded while a batch of it ran")
            state.unloaded = True
            self.live.remove(state)
            self.unloads.append(state)

    def state_bytes(self, state: Model) -> int:
        return state.bytes

    def handle_batch(self, batch: qs.Batch) -> list[str]:
        model = batch.state
        with self.lock:
            self.running.append(batch.key)
            self.order.append(batch.key)
        try:
            time.sleep(self.work_s)  # the device's work
            if self.hold & set(batch) and not self.gate.wait(GATE_LIMIT_S):
                raise TimeoutError("the test never released the gate")
            if not isinstance(model, Model) or model.key != batch.key or model.unloaded:
                with self.lock:
                    self.problems.append(f"batch of {batch.key} ran with {model}")
            return [f"{model.key}:{x}" for x in batch]
        finally:
            with self.lock:
                self.running.remove(batch.key)


class KeyedInProcess(_Recorded):
    """In worker processes: records each load (``loads``: ``key@pid``) and each item run in the
    test's Redis; an item "long" waits for the ``go`` gate (a SIGKILL lands mid-batch)."""

    name = "keyed"
    batch_size = 4
    batch_timeout = 0.0
    max_loaded_keys = 2

    def load_key(self, key: str) -> str:
        self.r.rpush(f"{self.rec}:loads", f"{key}@{os.getpid()}")
        return f"model-{key}"

    def handle_batch(self, batch: qs.Batch) -> list[str]:
        self.r.rpush(f"{self.rec}:exec", *[f"{batch.key}:{x}@{os.getpid()}" for x in batch])
        if "long" in batch:
            wait_for_key(self.r, f"{self.rec}:go")
        return [f"{batch.state}:{x}" for x in batch]


keyed = KeyedInProcess()
