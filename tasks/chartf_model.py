"""The character-level transformer behind ``tasks.chartf``: network, weights, and its two passes.

The vocabulary is charlm's (printable ASCII and the newline, ``tasks.charlm_model``). A small
GPT: learned token and position embeddings, ``layers`` pre-norm blocks (causal self-attention
with ``heads`` heads, a 4x MLP with GELU), a final norm, and the output head tied to the token
embedding. ``context`` positions at most. Weights are stored in float16 (about 1.6 MB,
committed as ``tasks/chartf.pt``) and computed in float32.

Training runs ``forward`` (whole windows, causal). Serving never does: it runs the blocks one
layer at a time through ``Blocks``, whose ``qkv`` and ``finish`` halves leave the attention to
the caller, which reads the keys and values of earlier positions from a paged KV cache
(``tasks.paged_kv``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from tasks.charlm_model import VOCAB

WEIGHTS = Path(__file__).with_name("chartf.pt")


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, 4 * d_model)
        self.down = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.ln2(x))))
        return out


class CharTransformer(nn.Module):
    """Embeddings -> ``layers`` blocks -> norm -> logits over ``VOCAB`` (tied head)."""

    def __init__(
        self, d_model: int = 128, heads: int = 4, layers: int = 4, context: int = 256
    ) -> None:
        super().__init__()
        self.d_model, self.heads, self.layers, self.context = d_model, heads, layers, context
        self.embed = nn.Embedding(len(VOCAB), d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.apply(_init)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` (batch, time <= context) -> logits (batch, time, vocab)."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.embed(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.ln(x) @ self.embed.weight.T
        return logits


def _init(module: nn.Module) -> None:
    # GPT-2's: small weights, so the tied head's first logits are near uniform.
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class Blocks:
    """The trained network split around its attention, for serving with a KV cache.

    ``embed(ids, positions)`` gives the residual stream of new positions; per layer,
    ``qkv(layer, x)`` gives their queries, keys and values (rows, heads, head size), the caller
    attends each query over its sequence's keys and values (cached and new), and
    ``finish(layer, x, attended)`` adds the attention output and the MLP. ``logits(x)`` ends.
    Every path (a prompt's prefill, a batched decode step, a recompute after preemption) runs
    these same functions, row-wise. The weights are taken out of the modules once: a decode
    step is some 60 small operations, and a module call's Python costs as much as a row's
    arithmetic here.
    """

    def __init__(self, model: CharTransformer) -> None:
        self.heads = model.heads
        self.head_size = model.d_model // model.heads
        self.layers = model.layers
        self.context = model.context
        self.scale = 1.0 / self.head_size**0.5
        self.d_model = model.d_model
        weights = {name: p.detach() for name, p in model.named_parameters()}
        self.token = weights["embed.weight"]
        self.pos = weights["pos.weight"]
        self.ln = (weights["ln.weight"], weights["ln.bias"])
        self.block = [
            {
                name.split(".", 2)[2]: w
                for name, w in weights.items()
                if name.startswith(f"blocks.{i}.")
            }
            for i in range(model.layers)
        ]

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.token.index_select(0, ids) + self.pos.index_select(0, positions)

    def qkv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w = self.block[layer]
        h = F.layer_norm(x, (self.d_model,), w["ln1.weight"], w["ln1.bias"])
        shape = (x.shape[0], self.heads, self.head_size)
        return tuple(
            z.reshape(shape) for z in F.linear(h, w["qkv.weight"], w["qkv.bias"]).chunk(3, dim=-1)
        )

    def finish(self, layer: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        w = self.block[layer]
        x = x + F.linear(attended.reshape(x.shape), w["proj.weight"], w["proj.bias"])
        h = F.layer_norm(x, (self.d_model,), w["ln2.weight"], w["ln2.bias"])
        h = F.gelu(F.linear(h, w["up.weight"], w["up.bias"]))
        return x + F.linear(h, w["down.weight"], w["down.bias"])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.d_model,), *self.ln) @ self.token.T


def load(path: Path = WEIGHTS, device: str = "cpu") -> CharTransformer:
    """The trained model in float32 on ``device``, in eval mode."""
    if not path.exists():
        raise FileNotFoundError(
            f"no weights at {path}: train them with `python -m tasks.chartf_train` "
            "(about ten minutes on one CPU core)"
        )
    saved = torch.load(path, map_location="cpu", weights_only=True)
    model = CharTransformer(saved["d_model"], saved["heads"], saved["layers"], saved["context"])
    model.load_state_dict({k: v.float() for k, v in saved["state"].items()})
    return model.to(device).eval()


def save(model: CharTransformer, path: Path = WEIGHTS) -> None:
    state = {k: v.detach().to("cpu", torch.float16) for k, v in model.state_dict().items()}
    torch.save(
        {
            "d_model": model.d_model,
            "heads": model.heads,
            "layers": model.layers,
            "context": model.context,
            "state": state,
        },
        path,
    )
