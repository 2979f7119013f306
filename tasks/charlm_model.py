"""The character-level GRU language model behind ``tasks.charlm``: vocabulary, network, weights.

Printable ASCII and the newline, one id each; anything else maps to ``?``. One GRU layer over
small embeddings: a recurrent state of one vector per sequence makes prefix caching exact and
cheap (a prompt prefix's state is one row of floats). Weights are stored in float16 (about
1 MB, committed as ``tasks/charlm.pt``) and computed in float32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
_INDEX = {ch: i for i, ch in enumerate(VOCAB)}
UNKNOWN = _INDEX["?"]
WEIGHTS = Path(__file__).with_name("charlm.pt")


def encode(text: str) -> list[int]:
    return [_INDEX.get(ch, UNKNOWN) for ch in text]


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


class CharGRU(nn.Module):
    """Embedding -> one GRU layer -> logits over ``VOCAB``."""

    def __init__(self, embed: int = 48, hidden: int = 384) -> None:
        super().__init__()
        self.hidden = hidden
        self.embed = nn.Embedding(len(VOCAB), embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, len(VOCAB))

    def forward(
        self, ids: torch.Tensor, h: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` (batch, time) -> logits (batch, time, vocab) and the last state (1, batch,
        hidden)."""
        out, h_n = self.gru(self.embed(ids), h)
        return self.head(out), h_n


class Stepper:
    """The trained GRU as a single-position cell for batched generation: a step is a handful
    of tensor operations whatever the batch (Python and dispatch, not arithmetic, dominate a
    small step on a CPU).

    The input side of a GRU step depends on the character alone, so ``embed @ W_ih + b_ih``
    is a table of one row per vocabulary id (96 x 3 hidden): a gather replaces the embedding
    and the input matmul. Every path that reads or generates (a sequence alone, a batch, one
    position or many) runs this same cell, so a sequence's text does not depend on how its
    reading was cut into steps.
    """

    def __init__(self, model: CharGRU) -> None:
        weights = {name: p.detach() for name, p in model.named_parameters()}
        with torch.inference_mode():
            self.table = (
                weights["embed.weight"] @ weights["gru.weight_ih_l0"].T + weights["gru.bias_ih_l0"]
            ).contiguous()
            self.w_hh = weights["gru.weight_hh_l0"].T.contiguous()
            self.b_hh = weights["gru.bias_hh_l0"].clone()
            self.w_out = weights["head.weight"].T.contiguous()
            self.b_out = weights["head.bias"].clone()
        self.hidden = model.hidden

    def cell(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The states (batch, hidden) after reading ``ids`` (batch,) from ``h`` (batch,
        hidden): torch.nn.GRU's equations."""
        size = self.hidden
        gi = self.table.index_select(0, ids)
        gh = torch.addmm(self.b_hh, h, self.w_hh)
        rz = torch.sigmoid(gi[:, : 2 * size] + gh[:, : 2 * size])
        n = torch.tanh(torch.addcmul(gi[:, 2 * size :], rz[:, :size], gh[:, 2 * size :]))
        return torch.lerp(n, h, rz[:, size:])  # (1 - z) * n + z * h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.b_out, h, self.w_out)


def load(path: Path = WEIGHTS, device: str = "cpu") -> CharGRU:
    """The trained model in float32 on ``device``, in eval mode."""
    if not path.exists():
        raise FileNotFoundError(
            f"no weights at {path}: train them with `python -m tasks.charlm_train` "
            "(a few minutes on one CPU core)"
        )
    saved = torch.load(path, map_location="cpu", weights_only=True)
    model = CharGRU(saved["embed"], saved["hidden"])
    model.load_state_dict({k: v.float() for k, v in saved["state"].items()})
    return model.to(device).eval()


def save(model: CharGRU, path: Path = WEIGHTS) -> None:
    state = {k: v.detach().to("cpu", torch.float16) for k, v in model.state_dict().items()}
    torch.save({"embed": model.embed.embedding_dim, "hidden": model.hidden, "state": state}, path)
