"""Text generation with a character-level GRU, served with continuous batching.

    queueserve worker tasks.charlm:charlm          # the StepServing
    queueserve worker tasks.charlm:charlm_static   # the same model, static generator batching

An item is a prompt string, or a dict ``{"prompt": str, "max_new": 200, "temperature": 0.0,
"seed": 0, "stop": None}``: ``temperature`` 0 decodes greedily; above 0 it samples with a
generator seeded per request, so a request's text does not depend on what else ran with it.
Each step outputs one character; an item's answer is the list of its characters (the default
``result``: sent as steps, a stream can rebuild any step lost on the way from it).

Prompts are read inside the batched decode steps, not in a separate prefill (``prefill``
only makes the state): every step, each sequence reads its next input with one GRU cell over
the running set; a joining sequence's inputs are its prompt's characters, and it answers
``qs.NO_OUTPUT`` until the last one gives its first output. While others in the step emit, a
joiner reads one prompt character per step when the running set is full (throughput-bound:
its position rides in the step everyone takes anyway) and up to ``prompt_chunk`` while slots
are free (latency-bound: the extra positions run for the joiners alone); a step in which
nobody emits reads whole prompts at once (``reading_chunk``, docs/generation.md).

The recurrent state is one vector, so the prefix cache is exact and cheap: the GRU's output at
every multiple of ``CACHE_EVERY`` prompt characters is the state there, offered to the cache;
a later prompt sharing a prefix resumes at its longest cached boundary and reads only the rest
(tests/integration/test_step_serving.py checks the text is the same as a cold run's).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import torch

import queueserve as qs
from tasks.charlm_model import VOCAB, CharGRU, Stepper, encode, load

CACHE_EVERY = 8  # prefix states at multiples of this are offered to the cache
# Prompt characters a sequence reads per step while others in the step emit and slots are
# free, at most (one per step once the running set is full: ``CharLM.reading_chunk``).
# Measured by bench/generate_chunks.py (docs/generation.md).
PROMPT_CHUNK = 64
WHOLE = 1 << 30  # no chunking: a step in which nobody emits reads whole prompts
DEFAULT_MAX_NEW = 200
NEWLINE = encode("\n")[0]
_first = itemgetter(0)


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
            raise ValueError(
                f"unknown charlm options {sorted(unknown)}; use prompt, max_new, "
                "temperature, seed, stop"
            )
        req = cls(**item)
        if not isinstance(req.prompt, str):
            raise TypeError(f"prompt must be a string, got {req.prompt!r:.80}")
        if not isinstance(req.max_new, int) or req.max_new < 0:
            raise ValueError(f"max_new must be an int >= 0, got {req.max_new!r}")
        return req


@dataclass(slots=True)
class State:
    """One sequence: its GRU state, what it still has to read, and what it generated."""

    req: Request
    h: torch.Tensor  # (hidden,): after reading ``pos`` characters
    feed: list[int]  # to read: the rest of the prompt, then each generated character
    pos: int  # characters read so far (prompt and generated)
    prompt_len: int
    rng: torch.Generator | None
    resume: qs.Resume
    made: str = ""

    def finished(self) -> bool:
        stop = self.req.stop
        return len(self.made) >= self.req.max_new or bool(stop and self.made.endswith(stop))

    def chunk(self, most: int) -> int:
        """Characters to read this step: up to ``most`` of the prompt, ending on a multiple of
        ``most``; 1 when generating."""
        return min(len(self.feed), most - self.pos % most)


class CharLM(qs.StepServing):
    """The GRU as a step serving: decode steps read prompts and emit characters."""

    name = "charlm"
    max_slots = 16
    max_batch_tokens = 16 * 600
    max_prefill_tokens = 4096
    prefix_cache_bytes = 32 * 1024 * 1024
    max_payload_bytes = 64 * 1024
    # Joining costs the running set little (prompts are read in decode steps): join at once.
    waiting_served_ratio = 0.0
    prompt_chunk = PROMPT_CHUNK
    torch_threads = 1  # on CPU (0: the worker's choice, cores / partitions)

    def __init__(self, *, prompt_chunk: int | None = None, **options: Any) -> None:
        super().__init__(**options)
        chunk = type(self).prompt_chunk if prompt_chunk is None else prompt_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"prompt_chunk must be an int >= 1, got {chunk!r}")
        self.prompt_chunk = chunk

    def setup(self, partition: qs.Partition) -> None:
        self.device = partition.device
        if self.device == "cpu" and self.torch_threads:
            # The GRU's step is a (slots x 384) @ (384 x 1152) matmul: a second thread
            # gains nothing on it, and on a shared machine its barrier waits whenever the
            # other core is busy (bench/generate.py measured both servings 1.3-1.8x faster
            # end to end with one). Process-wide: every serving of the partition gets it.
            torch.set_num_threads(self.torch_threads)
        self.model: CharGRU = load(device=partition.device)
        self.stepper = Stepper(self.model)

    # -- budgets and cache keys --------------------------------------------------------------
    def tokens(self, item: Any) -> tuple[int, int]:
        req = Request.of(item)
        return len(req.prompt), req.max_new

    def prompt_tokens(self, item: Any) -> list[int]:
        # The prompt's last character is the input of the step that emits the first output:
        # cached states are those of the prefixes before it.
        return encode(Request.of(item).prompt)[:-1]

    # -- steps ---------------------------------------------------------------------------------
    def prefill(self, items: list[Any]) -> list[State]:
        return self.prefill_from(items, [qs.Resume(()) for _ in items])

    def prefill_from(self, items: list[Any], resumes: list[qs.Resume]) -> list[State]:
        """A state per item, resumed from its cached prefix; nothing is read here."""
        states = []
        for item, resume in zip(items, resumes, strict=True):
            req = Request.of(item)
            ids = encode(req.prompt) or [NEWLINE]
            h = resume.state if resume.start else None
            if h is None:
                h = torch.zeros(self.model.hidden, device=self.device)
            rng = None
            if req.temperature > 0:
                rng = torch.Generator(device=self.device).manual_seed(req.seed)
            states.append(State(req, h, ids[resume.start :], resume.start, len(ids), rng, resume))
        return states

    def reading_chunk(self, rows: int) -> int:
        """Prompt characters a joining sequence reads in a step of ``rows`` sequences in which
        others emit: ``prompt_chunk`` while slots are free, 1 once the running set is full.

        A GRU position is sequential: the positions a joiner reads beyond the step's first are
        computed for the joiners alone (about 5x a shared position's cost per character here),
        while its first position rides in the step every sequence takes anyway. A full running
        set means requests wait for slots (the executor fills a free slot at once): throughput
        is what is short, so prompts are read one position per step, shared with everyone's
        decode. With slots free nobody waits for one, and spending a little on reading ahead
        shortens time to first token."""
        return 1 if rows >= self.max_slots else self.prompt_chunk

    @torch.inference_mode()
    def decode(self, states: list[State]) -> list[Any]:
        out: list[Any] = [qs.END] * len(states)
        going = [j for j, s in enumerate(states) if not s.finished()]
        if not going:
            return out
        # Chunks protect the sequences that emit in this step from a long call; with none,
        # each reads all of its prompt at once (what static generation's prefill does).
        emitting = any(len(states[j].feed) == 1 for j in going)
        most = self.reading_chunk(len(states)) if emitting else WHOLE
        # Longest reads first: the sequences still reading at any position are a prefix.
        if most == 1:
            sizes = [1] * len(going)
        else:
            order = sorted(
                ((states[j].chunk(most), j) for j in going), key=_first, reverse=True
            )  # stable: equal chunks keep their order
            sizes, going = [n for n, _ in order], [j for _, j in order]
        rows = [states[j] for j in going]
        h, kept = self._read(rows, sizes)
        # Rows whose feed is used up emit: the GRU's state after its last input gives it.
        emit = [k for k, s in enumerate(rows) if sizes[k] == len(s.feed)]
        chosen: dict[int, int] = {}
        if emit:
            logits = self.stepper.logits(h if len(emit) == len(rows) else h[emit])
            picks = logits.argmax(dim=-1).tolist()
            for i, k in enumerate(emit):
                s = rows[k]
                if s.rng is not None:
                    probs = torch.softmax(logits[i] / s.req.temperature, dim=-1)
                    picks[i] = int(torch.multinomial(probs, 1, generator=s.rng))
                chosen[k] = picks[i]
        # Every step computed before any state changes: a failed call can be re-run in halves.
        for k, boundary, state in kept:
            rows[k].resume.keep(boundary, state, state.numel() * state.element_size())
        for k, (j, s, h_k) in enumerate(zip(going, rows, h.unbind(0), strict=True)):
            n = sizes[k]
            s.h, s.pos, s.feed = h_k, s.pos + n, s.feed[n:]
            if k in chosen:
                s.feed = [chosen[k]]
                out[j] = VOCAB[chosen[k]]
                s.made += out[j]
            else:
                out[j] = qs.NO_OUTPUT
        return out

    def _read(
        self, rows: list[State], sizes: list[int]
    ) -> tuple[torch.Tensor, list[tuple[int, int, torch.Tensor]]]:
        """Each row reads its next ``sizes[k]`` characters (sizes in decreasing order): the
        last states (rows, hidden), and the prompt prefixes' states to offer to the cache
        (row, prefix length, state) at multiples of CACHE_EVERY read on the way."""
        h = torch.stack([s.h for s in rows])
        offers: dict[int, list[tuple[int, int]]] = {}  # position -> (row, prefix length)
        for k, (s, n) in enumerate(zip(rows, sizes, strict=True)):
            if s.resume.tokens and s.pos < s.prompt_len - 1:  # still reading, cached
                last = min(s.pos + n, s.prompt_len - 1)
                first = (s.pos // CACHE_EVERY + 1) * CACHE_EVERY
                for boundary in range(first, last + 1, CACHE_EVERY):
                    offers.setdefault(boundary - s.pos - 1, []).append((k, boundary))
        longest = sizes[0]
        if longest == 1:  # the common step: each sequence reads one character
            ids = torch.tensor([s.feed[0] for s in rows], device=self.device)
        else:
            ids = torch.tensor(
                [s.feed[:n] + [0] * (longest - n) for s, n in zip(rows, sizes, strict=True)],
                device=self.device,
            )
        kept = []
        active = len(rows)
        for t in range(longest):
            while sizes[active - 1] <= t:
                active -= 1
            columns = ids if longest == 1 else ids[:active, t]
            new = self.stepper.cell(columns, h[:active])
            if active == len(rows):
                h = new
            else:
                h[:active] = new
            for k, boundary in offers.get(t, ()):
                kept.append((k, boundary, new[k].clone()))
        return h, kept


class StaticCharLM(qs.Serving):
    """The same model and steps under static generator batching (the baseline of
    bench/generate.py): a batch's items run to the longest one's end, and nothing joins. Its
    first step reads every prompt whole, all 16 together position by position (static
    generation's prefill: each GRU position is one cell over every prompt still being read)."""

    name = "charlm_static"
    batch_size = CharLM.max_slots
    batch_timeout = 0.01
    max_payload_bytes = 64 * 1024

    def setup(self, partition: qs.Partition) -> None:
        self.lm = CharLM(prompt_chunk=CharLM.max_prefill_tokens)
        self.lm.setup(partition)

    def handle_batch(self, batch: qs.Batch) -> Iterator[list[Any]]:
        yield from self.lm.static_steps(list(batch))


charlm = CharLM()
charlm_static = StaticCharLM()
