"""Text generation with a character-level GRU, served with continuous batching.

    queueserve worker tasks.charlm:charlm          # the StepServing
    queueserve worker tasks.charlm:charlm_static   # the same model, static generator batching

An item is a prompt string, or a dict ``{"prompt": str, "max_new": 200, "temperature": 0.0,
"seed": 0, "stop": None}``: ``temperature`` 0 decodes greedily; above 0 it samples with a
generator seeded per request, so a request's text does not depend on what else ran with it.
Each step outputs one character; an item's answer is the list of its characters (the default
``result``: sent as steps, a stream can rebuild any step lost on the way from it).

Prompts are read inside the batched decode steps, not in a separate prefill (``prefill``
only makes the state): while other sequences in a step emit characters, a joining one reads
up to ``prompt_chunk`` prompt characters in that step's GRU call (chunks ending on multiples of
``prompt_chunk``) and answers ``qs.NO_OUTPUT`` until its prompt is read, so a join costs the
running set a few rows and a short call instead of a pause; a step in which nobody emits reads
whole prompts at once. Only then does the last prompt character give the first output.

The recurrent state is one vector, so the prefix cache is exact and cheap: the GRU's output at
every multiple of ``CACHE_EVERY`` prompt characters is the state there, offered to the cache;
a later prompt sharing a prefix resumes at its longest cached boundary and reads only the rest
(tests/integration/test_step_serving.py checks the text is the same as a cold run's).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import queueserve as qs
from tasks.charlm_model import CharGRU, decode, encode, load

CACHE_EVERY = 8  # prefix states at multiples of this are offered to the cache
# Prompt characters a sequence reads per step while others in the step emit, at most.
# Measured by bench/generate_chunks.py (docs/generation.md): longer chunks mean fewer steps
# to the first character, but a step reading a chunk lasts as long for every sequence in
# it; against 4, 8 and 16, 64 gave the lowest TTFT at 30/s and no worse time per character.
PROMPT_CHUNK = 64
WHOLE = 1 << 30  # no chunking: a step in which nobody emits reads whole prompts
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
    """One sequence: its GRU state, what it still has to read, and what it generated."""

    req: Request
    h: torch.Tensor  # (1, 1, hidden): after reading ``pos`` characters
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

    def __init__(self, *, prompt_chunk: int | None = None, **options: Any) -> None:
        super().__init__(**options)
        chunk = type(self).prompt_chunk if prompt_chunk is None else prompt_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"prompt_chunk must be an int >= 1, got {chunk!r}")
        self.prompt_chunk = chunk

    def setup(self, partition: qs.Partition) -> None:
        self.device = partition.device
        self.model: CharGRU = load(device=partition.device)

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
                h = torch.zeros(1, 1, self.model.hidden, device=self.device)
            rng = None
            if req.temperature > 0:
                rng = torch.Generator(device=self.device).manual_seed(req.seed)
            states.append(State(req, h, ids[resume.start:], resume.start, len(ids), rng,
                                resume))
        return states

    @torch.inference_mode()
    def decode(self, states: list[State]) -> list[Any]:
        out: list[Any] = [qs.END] * len(states)
        going = [j for j, s in enumerate(states) if not s.finished()]
        if not going:
            return out
        # Chunks protect the sequences that emit in this step from a long call; with none,
        # each reads all of its prompt at once (what static generation's prefill does).
        emitting = any(len(states[j].feed) == 1 for j in going)
        most = self.prompt_chunk if emitting else WHOLE
        sizes = [states[j].chunk(most) for j in going]
        outputs, h_n = self._read([states[j] for j in going], sizes)
        # Rows whose feed is used up emit: the GRU's last state is its output there.
        emit = [k for k, j in enumerate(going) if sizes[k] == len(states[j].feed)]
        chosen: dict[int, int] = {}
        if emit:
            logits = self.model.head(h_n[0, emit])
            picks = logits.argmax(dim=-1).tolist()
            for row, k in enumerate(emit):
                s = states[going[k]]
                if s.rng is not None:
                    probs = torch.softmax(logits[row] / s.req.temperature, dim=-1)
                    picks[row] = int(torch.multinomial(probs, 1, generator=s.rng))
                chosen[k] = picks[row]
        # Every step computed before any state changes: a failed call can be re-run in halves.
        for k, j in enumerate(going):
            s, n = states[j], sizes[k]
            # The GRU's output at each position is its state there: offer the prompt's
            # prefixes at multiples of CACHE_EVERY read in this call.
            last = min(s.pos + n, s.prompt_len - 1)
            for boundary in range((s.pos // CACHE_EVERY + 1) * CACHE_EVERY, last + 1,
                                  CACHE_EVERY):
                state = outputs[k, boundary - s.pos - 1][None, None].clone()
                s.resume.keep(boundary, state, state.numel() * state.element_size())
            s.h, s.pos, s.feed = h_n[:, k : k + 1], s.pos + n, s.feed[n:]
            if k in chosen:
                ch = decode([chosen[k]])
                s.feed, s.made = [chosen[k]], s.made + ch
                out[j] = ch
            else:
                out[j] = qs.NO_OUTPUT
        return out

    def _read(
        self, states: list[State], sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence reads its next ``sizes[k]`` characters: the GRU's outputs (batch,
        time, hidden; padded past each one's size) and its last states (1, batch, hidden)."""
        h = torch.cat([s.h for s in states], dim=1)
        longest = max(sizes)
        x = torch.tensor([s.feed[:n] + [0] * (longest - n) for s, n in zip(states, sizes,
                                                                          strict=True)],
                         device=self.device)
        if longest == 1:
            h_n = self.model.advance(x, h)
            return h_n.transpose(0, 1), h_n
        packed = pack_padded_sequence(self.model.embed(x), torch.tensor(sizes),
                                      batch_first=True, enforce_sorted=False)
        out, h_n = self.model.gru(packed, h)
        return pad_packed_sequence(out, batch_first=True)[0], h_n


class StaticCharLM(qs.Serving):
    """The same model and steps under static generator batching (the baseline of
    bench/generate.py): a batch's items run to the longest one's end, and nothing joins. Its
    first step reads every prompt whole, in one batched call (static generation's prefill,
    which measured a little cheaper here than reading in chunks)."""

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
