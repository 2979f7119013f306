"""A step serving with a state per batch key (``load_key``), for the tests of many models behind
a step serving (tests/integration/test_step_key_states.py): every call checks that it runs the
sequences of one key, with that key's state still loaded, and remembers loads and unloads."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

import queueserve as qs
from tests.support.key_app import GATE_LIMIT_S, Model


class KeyedSteps(qs.StepServing):
    """Item ``{"n": N}`` generates ``<key>:0`` .. ``<key>:N-1`` from its key's state
    (``{"hold": True}``: until ``gate`` opens); its answer is ``<key>/<N outputs>``. Items with
    a ``"prompt"`` use the prefix cache: prefill resumes from a cached prefix and offers the
    state after each prompt token. ``fail``: key -> loads of it that raise first; a key in
    ``slow`` loads only once ``load_gate`` opens; every load takes ``load_s``."""

    def __init__(
        self,
        *,
        fail: dict[str, int] | None = None,
        slow: Sequence[str] = (),
        step_s: float = 0.002,
        load_s: float = 0.0,
        **options: Any,
    ) -> None:
        options.setdefault("name", "ksteps")
        options.setdefault("max_slots", 4)
        super().__init__(**options)
        self.fail = dict(fail or {})
        self.slow = set(slow)
        self.step_s = step_s
        self.load_s = load_s  # each load takes this long (a model's weights read)
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.load_gate = threading.Event()
        self.loads: list[str] = []
        self.loading: list[str] = []  # keys whose load_key runs now
        self.failed: list[str] = []
        self.unloads: list[Model] = []
        self.live: list[Model] = []
        self.most = {"live": 0}
        self.running: dict[str, int] = {}  # key -> its sequences prefilled and not ended
        self.steps: dict[str, int] = {}  # key -> decode calls of it
        self.resumed: list[tuple[str, int]] = []  # (key, cached prompt tokens) per prefill
        self.problems: list[str] = []
        self._count = itertools.count(1)

    def load_key(self, key: str) -> Model:
        with self.lock:
            self.loads.append(key)
            if self.fail.get(key, 0) > 0:
                self.fail[key] -= 1
                self.failed.append(key)
                raise FileNotFoundError(f"no model for {key}")
            self.loading.append(key)
        if key in self.slow and not self.load_gate.wait(GATE_LIMIT_S):
            raise TimeoutError("the test never opened the load gate")
        time.sleep(self.load_s)
        with self.lock:
            self.loading.remove(key)
            model = Model(key, next(self._count))
            self.live.append(model)
            self.most["live"] = max(self.most["live"], len(self.live))
        return model

    def unload_key(self, key: str, state: Model) -> None:
        with self.lock:
            if state.key != key or state.unloaded or state not in self.live:
                self.problems.append(f"unload_key({key!r}) with {state}")
            if self.running.get(key):
                self.problems.append(f"{key} unloaded with {self.running[key]} sequences running")
            state.unloaded = True
            self.live.remove(state)
            self.unloads.append(state)

    def _model(self, states: list[dict[str, Any]], what: str) -> Model:
        """The call's key state, checked against the sequences it runs."""
        model = self.key_state
        keys = {s["key"] for s in states}
        if not isinstance(model, Model) or model.unloaded or keys != {model.key}:
            with self.lock:
                self.problems.append(f"{what} of {sorted(keys)} ran with {model}")
        return model  # type: ignore[no-any-return]

    def prefill(self, items: list[Any]) -> list[Any]:
        states = [
            {"key": item["key"], "n": item["n"], "i": 0, "hold": item.get("hold")} for item in items
        ]
        model = self._model(states, "prefill")
        with self.lock:
            self.running[model.key] = self.running.get(model.key, 0) + len(items)
        return states

    def prompt_tokens(self, item: Any) -> Sequence[Hashable] | None:
        return item.get("prompt")

    def prefill_from(self, items: list[Any], resumes: list[qs.Resume]) -> list[Any]:
        states = self.prefill(items)
        for state, resume in zip(states, resumes, strict=True):
            if resume.state is not None and resume.state["key"] != state["key"]:
                with self.lock:
                    self.problems.append(f"{state['key']} resumed from {resume.state}")
            with self.lock:
                self.resumed.append((state["key"], resume.start))
            for length in range(resume.start + 1, len(resume.tokens) + 1):
                resume.keep(length, {"key": state["key"], "length": length}, 1)
        return states

    def decode(self, states: list[Any]) -> list[Any]:
        model = self._model(states, "decode")
        time.sleep(self.step_s)  # the device's step
        held = any(s["hold"] for s in states) and not self.gate.is_set()
        out: list[Any] = []
        for s in states:
            if s["i"] >= s["n"] and not (s["hold"] and held):
                out.append(qs.END)
                continue
            out.append(f"{model.key}:{s['i']}")
            s["i"] += 1
        with self.lock:
            self.steps[model.key] = self.steps.get(model.key, 0) + 1
            ended = sum(o is qs.END for o in out)
            self.running[model.key] -= ended
        return out

    def result(self, state: Any, outputs: list[Any]) -> Any:
        model = self._model([state], "result")
        return f"{model.key}/{len(outputs)}"

    def tokens(self, item: Any) -> tuple[int, int]:
        return len(item.get("prompt", "")), 64
