"""Text generation with a character-level transformer and a paged KV cache, served with
continuous batching.

    queueserve worker tasks.chartf:chartf          # the StepServing
    queueserve worker tasks.chartf:chartf_static   # the same model, static generator batching

Items are charlm's (``tasks.charlm.Request``): a prompt string, or ``{"prompt": str,
"max_new": 200, "temperature": 0.0, "seed": 0, "stop": None}``; prompt + ``max_new`` must fit
the model's 256-position context. Each step outputs one character.

The keys and values of every sequence live in a pool of fixed-size blocks (``tasks.paged_kv``,
``block_size`` positions each) sized by ``kv_cache_bytes`` (or ``kv_blocks``), as in vLLM:

- **admission by free blocks**: a sequence starts (its prompt's keys and values computed)
  only when the blocks for its prompt and its next position are free, oldest first; until
  then it waits inside the serving, answering ``qs.NO_OUTPUT``. What runs never holds more KV
  than the pool;
- **preemption**: a running sequence that needs a new block when none is free takes it from
  the newest running sequence of the step, which gives back all its blocks and waits again;
  when blocks free up it is *recomputed* (its prompt and what it generated so far, in one
  prefill) and goes on from where it was. Its stream never shows a step twice: a preempted
  step emits nothing, the next emits the next character;
- **prefix sharing**: with the prefix cache on (``prefix_cache_bytes``), a prompt's blocks
  are offered to the cache at every block boundary and at its end, as ``CachedPrefix``es
  holding one reference on each block. A sequence whose prompt starts with a cached prefix
  (a new one, or one recomputed after preemption) shares those blocks, computing only the
  rest; the first write into a shared, partly filled block copies it (copy on write).

Batched decode attends each sequence over its own blocks: a gather of the pool by the block
tables, padded to the step's longest sequence and masked; no custom kernel.

A sequence dropped by the executor (cancelled, timed out, its caller gone) gives its blocks
back when its state is dropped (``BlockTable``'s finalizer): the executor tells a serving
nothing when a sequence leaves.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

import queueserve as qs
from tasks.charlm import NEWLINE, Request
from tasks.charlm_model import VOCAB, encode
from tasks.chartf_model import Blocks, load
from tasks.paged_kv import BlockPool, BlockTable, CachedPrefix, PoolExhausted

BLOCK_SIZE = 16
KV_CACHE_BYTES = 32 << 20  # 512 blocks of 16 positions (64 KiB each, float32)
WATERMARK = 0.01  # of the pool, kept free when admitting beside running sequences (vLLM's)


@dataclass
class Stats:
    """What the serving did, for tests and the benchmark (shared by a worker's copies)."""

    computed: int = 0  # positions whose keys and values a prefill computed (not shared)
    shared: int = 0  # positions a sequence started with from a cached prefix
    preempted: int = 0  # sequences that gave back their blocks to wait
    recomputed: int = 0  # preempted sequences started again
    pools: list[BlockPool] = field(default_factory=list)  # one per set-up partition


@dataclass(eq=False, slots=True, weakref_slot=True)
class State:
    """One sequence: its tokens (prompt, then generated) and, while it runs, its blocks.

    Running: ``table`` holds the keys and values of every token but the last (the next
    step's input). Waiting (not admitted yet, or preempted): ``table`` is None."""

    req: Request
    tokens: list[int]
    prompt_len: int
    serial: int  # arrival order: admission oldest first, preemption newest first
    rng: torch.Generator | None
    resume: qs.Resume
    table: BlockTable | None = None
    made: str = ""
    preempted: int = 0

    def finished(self) -> bool:
        stop = self.req.stop
        return len(self.made) >= self.req.max_new or bool(stop and self.made.endswith(stop))


class CharTF(qs.StepServing):
    """The transformer as a step serving over a paged KV cache (module docstring)."""

    name = "chartf"
    max_slots = 16
    # The block pool, not the token budget, bounds what runs: this only says what a slot may
    # hold at most (a whole context).
    max_batch_tokens = 16 * 256
    max_prefill_tokens = 4096
    prefix_cache_bytes = 8 << 20
    max_payload_bytes = 64 * 1024
    kv_cache_bytes = KV_CACHE_BYTES
    kv_blocks = 0  # > 0: the pool's size in blocks (kv_cache_bytes is then ignored)
    block_size = BLOCK_SIZE
    torch_threads = 1  # on CPU (0: the worker's choice)

    def __init__(
        self,
        *,
        kv_cache_bytes: int | None = None,
        kv_blocks: int | None = None,
        block_size: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        cls = type(self)
        self.kv_cache_bytes = _positive(
            "kv_cache_bytes", cls.kv_cache_bytes if kv_cache_bytes is None else kv_cache_bytes
        )
        self.kv_blocks = _positive(
            "kv_blocks", cls.kv_blocks if kv_blocks is None else kv_blocks, zero=True
        )
        self.block_size = _positive(
            "block_size", cls.block_size if block_size is None else block_size
        )
        self.stats = Stats()
        self._serial = itertools.count()

    def setup(self, partition: qs.Partition) -> None:
        self.device = partition.device
        if self.device == "cpu" and self.torch_threads:
            torch.set_num_threads(self.torch_threads)  # as charlm: one core's matmuls
        self.net = Blocks(load(device=self.device))
        per_block = BlockPool.block_bytes(
            self.block_size, self.net.layers, self.net.heads, self.net.head_size
        )
        blocks = self.kv_blocks or self.kv_cache_bytes // per_block
        self.block_bytes = per_block
        # The prefix cache pins at most prefix_cache_bytes of blocks; the rest is the running
        # set's, and one whole context must fit there or a long sequence could never run.
        self.cache_blocks = self.prefix_cache_bytes // per_block
        context_blocks = math.ceil(self.net.context / self.block_size)
        if blocks - self.cache_blocks < context_blocks:
            raise ValueError(
                f"{type(self).__name__}: a pool of {blocks} KV blocks ({per_block} bytes each) "
                f"less the prefix cache's {self.cache_blocks} cannot hold one whole context "
                f"({context_blocks} blocks of {self.block_size}); raise kv_cache_bytes (or "
                "kv_blocks) or lower prefix_cache_bytes"
            )
        self.pool = BlockPool(
            blocks,
            self.block_size,
            self.net.layers,
            self.net.heads,
            self.net.head_size,
            device=self.device,
        )
        self.stats.pools.append(self.pool)
        self.watermark = math.ceil(blocks * WATERMARK)
        self._cached: weakref.WeakValueDictionary[tuple[int, ...], CachedPrefix] = (
            weakref.WeakValueDictionary()
        )
        self._waiting: weakref.WeakSet[State] = weakref.WeakSet()
        self._running: weakref.WeakSet[State] = weakref.WeakSet()

    # -- budgets and cache keys --------------------------------------------------------------
    def tokens(self, item: Any) -> tuple[int, int]:
        req = self._request(item)
        return len(_ids(req)), req.max_new

    def _request(self, item: Any) -> Request:
        req = Request.of(item)
        positions = len(_ids(req)) + req.max_new - 1
        if positions > self.net.context:
            raise ValueError(
                f"prompt ({len(_ids(req))} characters) + max_new ({req.max_new}) "
                f"- 1 = {positions} positions, more than the model's context of "
                f"{self.net.context}; shorten the prompt or lower max_new"
            )
        return req

    def prompt_tokens(self, item: Any) -> list[int]:
        # The prompt's last character is the input of the step that emits the first output:
        # what can be cached are the keys and values of the positions before it.
        return _ids(Request.of(item))[:-1]

    # -- steps ---------------------------------------------------------------------------------
    def prefill(self, items: list[Any]) -> list[State]:
        return self.prefill_from(items, [qs.Resume(()) for _ in items])

    @torch.inference_mode()
    def prefill_from(self, items: list[Any], resumes: list[qs.Resume]) -> list[State]:
        """A state per item; those whose blocks are free start now (their prompts computed
        together, after the cached prefix each shares), the others wait in line."""
        states = []
        for item, resume in zip(items, resumes, strict=True):
            req = self._request(item)
            rng = None
            if req.temperature > 0:
                rng = torch.Generator(device=self.device).manual_seed(req.seed)
            ids = _ids(req)
            states.append(State(req, ids, len(ids), next(self._serial), rng, resume))
        fresh = [s for s in states if not s.finished()]
        # Nobody overtakes a sequence already waiting for blocks (a preempted one included).
        started = self._admit(fresh) if not self._waiting else []
        self._compute(started)
        self._waiting.update(fresh[len(started) :])
        for resume in resumes:
            # The cached prefix the executor found is shared through the block table (or
            # looked up again at admission): held here as well, it would pin its blocks while
            # its sequence waits, beyond the cache's bound.
            resume.state = None
        return states

    @torch.inference_mode()
    def decode(self, states: list[State]) -> list[Any]:
        out: list[Any] = [qs.NO_OUTPUT] * len(states)
        live: list[tuple[int, int]] = []  # (serial, index in states) of the unfinished
        for j, s in enumerate(states):
            if s.finished():
                out[j] = qs.END
            else:
                live.append((s.serial, j))
        live.sort()  # oldest first; states mostly come in that order already
        running = [j for _, j in live if states[j].table is not None]
        waiting = [j for _, j in live if states[j].table is None]
        running, preempted = self._make_room(states, running)
        if waiting and not preempted:  # blocks were short this step: nothing new starts
            started = self._admit([states[j] for j in waiting])
            if started:
                self._compute(started)
                running = sorted(running + waiting[: len(started)], key=lambda j: states[j].serial)
        if not running:
            return out
        seqs = [states[j] for j in running]
        picks = self._sample(seqs, self._forward(seqs))
        # Every step computed before any state changes (but preemption and admission, which
        # leave valid states): a failed call can be re-run in halves.
        for j, s, pick in zip(running, seqs, picks, strict=True):
            table = s.table
            assert table is not None
            table.stored(1)
            s.tokens.append(pick)
            char = VOCAB[pick]
            s.made += char
            out[j] = char
            if s.finished():  # its last character: nothing more to attend over
                table.release()
                s.table = None
                self._running.discard(s)
        return out

    # -- blocks: admission, preemption ---------------------------------------------------------
    def _admit(self, waiting: list[State]) -> list[State]:
        """Start the oldest waiting sequences whose blocks are free (sharing their longest
        cached prefix), in order: the first that does not fit stops the rest."""
        started: list[State] = []
        for s in waiting:
            table = BlockTable(self.pool)
            prefix = self._longest_cached(s)
            if prefix is not None:
                table.share(prefix)
            need = table.needs(len(s.tokens) - table.length)
            keep_free = self.watermark if self._running or started else 0
            if need + keep_free > self.pool.free:
                table.release()
                break
            table.reserve(len(s.tokens) - table.length)
            self.stats.shared += table.length
            if s.preempted:
                self.stats.recomputed += 1
            s.table = table
            self._waiting.discard(s)
            self._running.add(s)
            started.append(s)
        return started

    def _make_room(self, states: list[State], running: list[int]) -> tuple[list[int], bool]:
        """Room for the next position of each running sequence (``running``: indexes in
        ``states``, oldest first); when the pool is short, the newest gives its blocks back
        (it may be the one asking). The indexes still running, and whether any was
        preempted."""
        kept = list(running)
        preempted = False
        i = 0
        while i < len(kept):
            table = states[kept[i]].table
            assert table is not None
            try:
                table.reserve(1)
                i += 1
            except PoolExhausted:
                self._preempt(states[kept.pop()])
                preempted = True
        return kept, preempted

    def _preempt(self, s: State) -> None:
        assert s.table is not None
        s.table.release()
        s.table = None
        s.preempted += 1
        self._running.discard(s)
        self._waiting.add(s)
        self.stats.preempted += 1

    # -- prefix cache ----------------------------------------------------------------------------
    def _longest_cached(self, s: State) -> CachedPrefix | None:
        """The longest cached prefix of the positions ``s`` needs computed: one offered at a
        block boundary, or at the end of a prompt."""
        if not s.resume.tokens:
            return None
        stop = min(len(s.tokens) - 1, len(s.resume.tokens))
        size = self.block_size
        lengths = [stop] if stop % size else []
        lengths += range(stop // size * size, 0, -size)
        for length in lengths:
            prefix = self._cached.get(tuple(s.tokens[:length]))
            if prefix is not None:
                return prefix
        return None

    def _offer(self, s: State, start: int, stop: int) -> None:
        """Offer the prompt prefixes computed in ``start..stop`` to the cache: at each block
        boundary, and at the prompt's end."""
        assert s.table is not None
        stop = min(stop, len(s.resume.tokens))
        if stop <= start:
            return
        size = self.block_size
        lengths = list(range((start // size + 1) * size, stop + 1, size))
        if stop % size:
            lengths.append(stop)
        for length in lengths:
            key = tuple(s.tokens[:length])
            prefix = self._cached.get(key)
            if prefix is None:
                prefix = self._cached[key] = s.table.prefix(length)
            s.resume.keep(length, prefix, len(prefix.blocks) * self.block_bytes)

    # -- the network over the blocks -------------------------------------------------------------
    def _compute(self, seqs: list[State]) -> None:
        """Keys and values of every token but the last of each sequence, after what its table
        already holds (a shared prefix), all sequences' positions in one pass per layer."""
        spans = []
        for s in seqs:
            assert s.table is not None
            start, stop = s.table.length, len(s.tokens) - 1
            if stop > start:
                spans.append((s, start, stop))
        if not spans:
            return
        net, device = self.net, self.device
        ids = torch.tensor([t for s, a, b in spans for t in s.tokens[a:b]], device=device)
        positions = torch.tensor([p for _, a, b in spans for p in range(a, b)], device=device)
        blocks, offsets = [], []
        for s, a, b in spans:
            assert s.table is not None
            ids_of, offsets_of = s.table.slots(a, b)
            blocks += ids_of
            offsets += offsets_of
        slots = torch.tensor(
            [b * self.block_size + o for b, o in zip(blocks, offsets, strict=True)], device=device
        )
        # What each new position may see: its sequence's positions up to itself.
        visible = [
            torch.arange(b, device=device)[None, :] <= torch.arange(a, b, device=device)[:, None]
            for _, a, b in spans
        ]
        indexes = [self._index([s.table.blocks], b) for s, _, b in spans if s.table is not None]
        x = net.embed(ids, positions)
        for layer in range(net.layers):
            q, k, v = net.qkv(layer, x)
            self._store(layer, slots, k, v)
            parts, row = [], 0
            for (_, a, b), seen, index in zip(spans, visible, indexes, strict=True):
                keys, values = self._gather(layer, index, 1, b)
                parts.append(
                    _attend(
                        q[row : row + b - a].transpose(0, 1)[None],
                        keys,
                        values,
                        seen[None, None],
                        net.scale,
                    )[0].transpose(0, 1)
                )
                row += b - a
            x = net.finish(layer, x, torch.cat(parts))
        for s, a, b in spans:
            assert s.table is not None
            s.table.stored(b - a)
            self.stats.computed += b - a
            self._offer(s, a, b)

    def _forward(self, seqs: list[State]) -> torch.Tensor:
        """One position of each sequence (its last token), attending over its own blocks:
        the logits of its next token."""
        net, size, n = self.net, self.block_size, len(seqs)
        pos: list[int] = []
        tokens: list[int] = []
        where: list[int] = []
        tables: list[list[int]] = []
        for s in seqs:
            table = s.table
            assert table is not None
            p = table.length
            pos.append(p)
            tokens.append(s.tokens[-1])
            where.append(table.blocks[p // size] * size + p % size)
            tables.append(table.blocks)
        # Everything the step indexes with goes to the device as one tensor: on CUDA each
        # torch.tensor made from a list is a synchronous copy of its own, and the CPU waits.
        flat = pos + tokens + where
        shapes: list[tuple[int, int, int]] = []  # per group: rows, longest, blocks
        for rows in self._by_length(pos):
            longest = max(pos[r] for r in rows) + 1
            count = math.ceil(longest / size)
            flat += rows
            flat += [pos[r] for r in rows]
            flat += [b for r in rows for b in tables[r][:count] + [0] * (count - len(tables[r]))]
            shapes.append((len(rows), longest, len(rows) * count))
        host = torch.tensor(flat, device=self.device)
        positions, ids, slots = host[:n], host[n : 2 * n], host[2 * n : 3 * n]
        groups: list[_Group] = []
        at = 3 * n
        for count, longest, blocks in shapes:
            index, row_pos = host[at : at + count], host[at + count : at + 2 * count]
            at += 2 * count
            seen = torch.arange(longest, device=self.device)[None, :] <= row_pos[:, None]
            groups.append(_Group(index, longest, host[at : at + blocks], seen[:, None, None, :]))
            at += blocks
        x = net.embed(ids, positions)
        for layer in range(net.layers):
            q, k, v = net.qkv(layer, x)
            self._store(layer, slots, k, v)
            if len(groups) == 1:
                attended = self._attend_group(layer, q, groups[0])
            else:
                attended = torch.empty_like(q)
                for group in groups:
                    attended[group.rows] = self._attend_group(layer, q[group.rows], group)
            x = net.finish(layer, x, attended)
        return net.logits(x)

    def _by_length(self, pos: list[int]) -> list[list[int]]:
        """The rows of a step in groups of like lengths (1, 2, 3-4, 5-8, 9-16... blocks): each
        group is padded to its own longest row, not the step's, so a long sequence does not
        make fifteen short ones attend over its length."""
        groups: dict[int, list[int]] = {}
        for row, p in enumerate(pos):
            groups.setdefault((p // self.block_size).bit_length(), []).append(row)
        return list(groups.values())

    def _attend_group(self, layer: int, q: torch.Tensor, group: _Group) -> torch.Tensor:
        keys, values = self._gather(layer, group.blocks, len(q), group.longest)
        return _attend(q[:, :, None], keys, values, group.seen, self.net.scale)[:, :, 0]

    def _store(
        self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Write the keys and values of new positions at ``slots`` (block x block_size +
        offset) of ``layer``. Writing a position again writes the same numbers: a step
        re-run in halves after a failure changes nothing."""
        shape = (-1, self.net.heads, self.net.head_size)
        self.pool.k[layer].view(shape).index_copy_(0, slots, keys)
        self.pool.v[layer].view(shape).index_copy_(0, slots, values)

    def _index(self, tables: list[list[int]], positions: int) -> torch.Tensor:
        """The blocks holding the first ``positions`` positions of each table, flat; a shorter
        table padded with block 0 (its positions are masked)."""
        count = math.ceil(positions / self.block_size)
        return torch.tensor(
            [b for t in tables for b in t[:count] + [0] * (count - len(t))], device=self.device
        )

    def _gather(
        self, layer: int, index: torch.Tensor, rows: int, positions: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the blocks ``index`` (from ``_index``) as (rows, positions,
        heads, head size): one index_select per tensor (advanced indexing is slower here)."""
        shape = (rows, -1, self.net.heads, self.net.head_size)
        keys = self.pool.k[layer].index_select(0, index).view(shape)[:, :positions]
        values = self.pool.v[layer].index_select(0, index).view(shape)[:, :positions]
        return keys, values

    def _sample(self, seqs: list[State], logits: torch.Tensor) -> list[int]:
        picks: list[int] = logits.argmax(dim=-1).tolist()
        for i, s in enumerate(seqs):
            if s.rng is not None:
                probs = torch.softmax(logits[i] / s.req.temperature, dim=-1)
                picks[i] = int(torch.multinomial(probs, 1, generator=s.rng))
        return picks


@dataclass(frozen=True, slots=True)
class _Group:
    """Rows of a decode step attended together: their indexes in the step, their longest
    length, the blocks to gather (``CharTF._index``) and what each row may see."""

    rows: torch.Tensor
    longest: int
    blocks: torch.Tensor
    seen: torch.Tensor


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, scale: float
) -> torch.Tensor:
    """Queries (rows, heads, queries, d) over each row's gathered keys and values (rows,
    positions, heads, d); ``seen`` (broadcast to rows, heads, queries, positions) is true
    where a query may see a position.

    On a CPU, torch's fused attention: about 2.5x the speed of the same arithmetic as einsum
    and softmax at 16 rows of 240 positions. On CUDA, that plain arithmetic: its kernels exist
    in every torch version, where which fused kernel takes a broadcast boolean mask in float32
    has changed across versions (and this was written without a device to check one on)."""
    if q.is_cuda:
        return _attend_plain(q, keys, values, seen, scale)
    return F.scaled_dot_product_attention(
        q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=seen, scale=scale
    )


def _attend_plain(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, scale: float
) -> torch.Tensor:
    """``_attend`` as matmuls and a softmax."""
    scores = (q @ keys.permute(0, 2, 3, 1)) * scale
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values.transpose(1, 2)


def _ids(req: Request) -> list[int]:
    return encode(req.prompt) or [NEWLINE]


def _positive(name: str, value: object, zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise ValueError(f"{name} must be an int >= {0 if zero else 1}, got {value!r}")
    return value


class StaticCharTF(qs.Serving):
    """The same model and steps under static generator batching (bench/generate.py's
    baseline): a batch's items run to the longest one's end, and nothing joins."""

    name = "chartf_static"
    batch_size = CharTF.max_slots
    batch_timeout = 0.01
    max_payload_bytes = 64 * 1024

    def setup(self, partition: qs.Partition) -> None:
        self.lm = CharTF(prefix_cache_bytes=0)
        self.lm.setup(partition)

    def handle_batch(self, batch: qs.Batch) -> Iterator[list[Any]]:
        yield from self.lm.static_steps(list(batch))


chartf = CharTF()
chartf_static = StaticCharTF()
