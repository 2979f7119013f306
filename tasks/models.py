"""Many models behind one serving: the character GRU of tasks/charlm.py with a low-rank adapter
per batch key, as per-customer fine-tunes (LoRA) over one base model are served.

    queueserve worker tasks.models:adapters

An item is a text; its answer is the text's mean log-likelihood per character (nats) under its
batch key's model: the trained GRU whose output layer carries the key's rank-8 adapter (made
from the key's CRC-32, so every partition loads the same one). Key ``base`` is the base model
alone. Each load reads the weights file again and builds the model on the partition's device,
as a real adapter store would be read: tens of milliseconds on a CPU, against a few for a
batch, so the LRU and reads that follow what is loaded are what keeps the device busy
(docs/usage.md, "Many models behind one serving").
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.nn.functional as F

import queueserve as qs
from tasks.charlm_model import VOCAB, CharGRU, encode, load

RANK = 8
ADAPTER_SCALE = 0.05  # an adapter moves the output layer by about this much per weight
MAX_CHARS = 512  # longer texts are scored on their first MAX_CHARS characters


def adapter(key: str, hidden: int) -> torch.Tensor:
    """The key's change to the output layer's weight (vocab x hidden): B @ A of rank RANK,
    drawn from the key's CRC-32."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    a = torch.randn(RANK, hidden, generator=gen)
    b = torch.randn(len(VOCAB), RANK, generator=gen)
    delta: torch.Tensor = ADAPTER_SCALE * (b @ a) / RANK**0.5
    return delta


def load_model(key: str, device: str = "cpu") -> CharGRU:
    """The model of batch key ``key`` on ``device``: the base weights, read from their file,
    with the key's adapter merged into the output layer (none for ``base``)."""
    model = load(device=device)
    if key != "base":
        with torch.inference_mode():
            model.head.weight += adapter(key, model.hidden).to(device)
    return model


def log_likelihood(model: CharGRU, texts: list[str]) -> list[float]:
    """Each text's mean log-probability per predicted character (0.0 under two characters)."""
    ids = [encode(t[:MAX_CHARS]) for t in texts]
    longest = max(2, *(len(x) for x in ids))
    device = model.head.weight.device
    batch = torch.zeros(len(ids), longest, dtype=torch.long)
    mask = torch.zeros(len(ids), longest - 1)
    for i, x in enumerate(ids):
        batch[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        mask[i, : max(0, len(x) - 1)] = 1.0
    batch, mask = batch.to(device), mask.to(device)
    with torch.inference_mode():
        logits, _ = model(batch[:, :-1])
        logp = F.log_softmax(logits, dim=-1).gather(2, batch[:, 1:, None])[..., 0]
        totals = (logp * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return [float(v) for v in totals.cpu()]


class Adapters(qs.Serving):
    """Scores texts under their batch key's model; at most 4 models held per partition."""

    name = "adapters"
    batch_size = 32
    batch_timeout = 0.005
    max_loaded_keys = 4

    def setup(self, partition: qs.Partition) -> None:
        self.device = partition.device

    def load_key(self, key: str) -> CharGRU:
        return load_model(key, self.device)

    def unload_key(self, key: str, state: CharGRU) -> None:
        if self.device.startswith("cuda"):
            state.to("cpu")
            torch.cuda.empty_cache()

    def state_bytes(self, state: CharGRU) -> int:
        return sum(p.numel() * p.element_size() for p in state.parameters())

    def handle_batch(self, batch: qs.Batch) -> list[float]:
        texts: list[Any] = list(batch)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("adapters scores texts: send str items")
        return log_likelihood(batch.state, texts)


adapters = Adapters()
