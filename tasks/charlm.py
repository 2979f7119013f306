"""Text generation with a character-level GRU, served with continuous batching.

    queueserve worker tasks.charlm:charlm          # the StepServing
    queueserve worker tasks.charlm:charlm_static   # the same model, static generator batching

An item is a prompt string, or a dict ``{"prompt": str, "max_new": 200, "temperature": 0.0,
"seed": 0, "stop": None}``: ``temperature`` 0 decodes greedily; above 0 it samples with a
generator seeded per request, so a request's text does not depend on what else ran with it.
Each step outputs one character; an item's answer is the list of its characters (the default
``result``: sent as steps, a stream can rebuild any step lost on the way from it).

The recurrent state is one vector, so the prefix cache is exact and cheap: prefill reads the
prompt in one GRU call and offers the state at every multiple of ``CHUNK`` characters (the GRU's
output there); a later prompt sharing a prefix resumes at its longest cached boundary and reads
only the rest (tests/test_step_serving.py checks that the text is the same as a cold run's).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

import queueserve as qs
from tasks.charlm_model import CharGRU, decode, encode, load

CHUNK = 16  # prefill granularity, and where prefix states are offered to the cache
DEFAULT_MAX_NEW = 200
NEWLINE = encode("\n")[0]


@dataclass(slots=True)
class Request:
    prompt: str
    max_new: int = DEFAULT_MAX_NEW
    temperature: float = 0.0
    seed: int = 0
    stop: str | None = None

    @classmethod
    def of(cls, item: Any) -> Request:
        if isinstance(item, str):
            return cls(item)
        if not isinstance(item, dict):
            raise TypeError(f"a charlm item is a prompt string or a dict, got {item!r:.80}")
        unknown = set(item) - {"prompt", "max_new", "temperature", "seed", "stop"}
        if unknown:
            raise ValueError(f"unknown charlm options {sorted(unknown)}; use prompt, max_new, "
                             "temperature, seed, stop")
        req = cls(**item)
        if not isinstance(req.prompt, str):
            raise TypeError(f"prompt must be a string, got {req.prompt!r:.80}")
        if not isinstance(req.max_new, int) or req.max_new < 0:
            raise ValueError(f"max_new must be an int >= 0, got {req.max_new!r}")
        return req


@dataclass(slots=True)
class State:
    """One sequence: its GRU state, the next input character, and what it generated."""

    req: Request
    h: torch.Tensor  # (1, 1, hidden)
    last: int
    rng: torch.Generator | None
    made: str = ""


class CharLM(qs.StepServing):
    """The GRU as a step serving: prefill reads prompts, each decode step emits a character."""

    name = "charlm"
    max_slots = 16
    max_batch_tokens = 16 * 600
    max_prefill_tokens = 4096
    prefix_cache_bytes = 32 * 1024 * 1024
    max_payload_bytes = 64 * 1024

    def setup(self, partition: qs.Partition) -> None:
        self.device = partition.device
        self.model: CharGRU = load(device=partition.device)

    # -- budgets and cache keys --------------------------------------------------------------
    def tokens(self, item: Any) -> tuple[int, int]:
        req = Request.of(item)
        return len(req.prompt), req.max_new

    def prompt_tokens(self, item: Any) -> list[int]:
        # Prefill reads all of the prompt but its last character, which is the first decode
        # step's input: the cached state of a prefix is the state before that character.
        return encode(Request.of(item).prompt)[:-1]

    # -- steps ---------------------------------------------------------------------------------
    def prefill(self, items: list[Any]) -> list[State]:
        return self.prefill_from(items, [qs.Resume(()) for _ in items])

    @torch.inference_mode()
    def prefill_from(self, items: list[Any], resumes: list[qs.Resume]) -> list[State]:
        states = []
        for item, resume in zip(items, resumes, strict=True):
            req = Request.of(item)
            ids = encode(req.prompt) or [NEWLINE]
            h = resume.state if resume.start else None
            end = len(ids) - 1
            if resume.start < end:
                x = torch.tensor(ids[resume.start : end], device=self.device)[None]
                # One GRU layer: its output at each position is the state there, so one call
                # reads the prompt and yields every CHUNK boundary's state for the cache.
                out, h = self.model.gru(self.model.embed(x), h)
                for boundary in range((resume.start // CHUNK + 1) * CHUNK, end + 1, CHUNK):
                    state = out[:, boundary - resume.start - 1][None].clone()
                    resume.keep(boundary, state, state.numel() * state.element_size())
            if h is None:
                h = torch.zeros(1, 1, self.model.hidden, device=self.device)
            rng = None
            if req.temperature > 0:
                rng = torch.Generator(device=self.device).manual_seed(req.seed)
            states.append(State(req, h, ids[-1], rng))
        return states

    @torch.inference_mode()
    def decode(self, states: list[State]) -> list[Any]:
        x = torch.tensor([[s.last] for s in states], device=self.device)
        h = torch.cat([s.h for s in states], dim=1)
        logits, h_new = self.model(x, h)
        logits = logits[:, -1]
        chosen = logits.argmax(dim=-1).tolist()
        for j, s in enumerate(states):
            if s.rng is not None:
                probs = torch.softmax(logits[j] / s.req.temperature, dim=-1)
                chosen[j] = int(torch.multinomial(probs, 1, generator=s.rng))
        out: list[Any] = []
        # Every step computed before any state changes: a failed call can be re-run in halves.
        for j, s in enumerate(states):
            stop = s.req.stop
            if len(s.made) >= s.req.max_new or (stop and s.made.endswith(stop)):
                out.append(qs.END)
                continue
            ch = decode([chosen[j]])
            s.h, s.last, s.made = h_new[:, j : j + 1], chosen[j], s.made + ch
            out.append(ch)
        return out


class StaticCharLM(qs.Serving):
    """The same model and steps under static generator batching (the baseline of
    bench/generate.py): a batch's items run to the longest one's end, and nothing joins."""

    name = "charlm_static"
    batch_size = CharLM.max_slots
    batch_timeout = 0.01
    max_payload_bytes = 64 * 1024

    def setup(self, partition: qs.Partition) -> None:
        self.lm = CharLM()
        self.lm.setup(partition)

    def handle_batch(self, batch: qs.Batch) -> Iterator[list[Any]]:
        yield from self.lm.static_steps(list(batch))


charlm = CharLM()
charlm_static = StaticCharLM()
