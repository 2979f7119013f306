"""Train the character-level GRU of ``tasks.charlm`` on the standard library's docstrings.

    python -m tasks.charlm_train [--minutes 4] [--out tasks/charlm.pt]

One CPU thread, a fixed seed and a time budget: it trains on random 128-character windows of
the corpus (``tasks.corpus``; the last 5% held out) until the budget is spent, prints the
held-out loss (nats per character) as it goes, and saves float16 weights (about 1 MB).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from torch import nn

from tasks.charlm_model import WEIGHTS, CharGRU, encode, save
from tasks.corpus import stdlib_passages

WINDOW = 128
BATCH = 64


def corpus_ids() -> torch.Tensor:
    text = "\n\n".join(p.text for p in stdlib_passages())
    return torch.tensor(encode(text), dtype=torch.long)


def batches(ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(ids) - WINDOW - 1, (BATCH,), generator=gen)
    rows = torch.stack([ids[s : s + WINDOW + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def held_out_loss(model: CharGRU, ids: torch.Tensor, gen: torch.Generator) -> float:
    with torch.no_grad():
        x, y = batches(ids, gen)
        logits, _ = model(x)
        return float(
            nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        )


def train(minutes: float, out: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    ids = corpus_ids()
    cut = int(len(ids) * 0.95)
    train_ids, test_ids = ids[:cut], ids[cut:]
    print(f"corpus: {len(ids):,} characters ({len(train_ids):,} for training)")
    model = CharGRU()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()
    started = time.monotonic()
    budget = minutes * 60
    step = 0
    while time.monotonic() - started < budget:
        # Cosine decay over the time budget rather than a step count: the machine's speed varies.
        frac = (time.monotonic() - started) / budget
        for group in opt.param_groups:
            group["lr"] = 3e-4 + (3e-3 - 3e-4) * 0.5 * (1 + math.cos(math.pi * frac))
        x, y = batches(train_ids, gen)
        logits, _ = model(x)
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 100 == 0:
            print(
                f"step {step}: train {loss.item():.3f}, held out "
                f"{held_out_loss(model, test_ids, gen):.3f} nats/char "
                f"({time.monotonic() - started:.0f}s)",
                flush=True,
            )
    print(f"{step} steps; held out {held_out_loss(model, test_ids, gen):.3f} nats/char")
    save(model, out)
    print(f"saved {out} ({out.stat().st_size / 1e6:.2f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="training time budget")
    parser.add_argument("--out", type=Path, default=WEIGHTS)
    args = parser.parse_args()
    train(args.minutes, args.out)


if __name__ == "__main__":
    main()
