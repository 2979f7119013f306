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

    def advance(self, ids: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
        """The state after reading ``ids`` (batch, time), without computing logits."""
        _, h_n = self.gru(self.embed(ids), h)
        return h_n


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
    torch.save(
        {"embed": model.embed.embedding_dim, "hidden": model.hidden, "state": state}, path
    )
