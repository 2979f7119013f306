"""Train the character-level transformer of ``tasks.chartf`` on the standard library's docstrings.

    python -m tasks.chartf_train [--minutes 9] [--threads 1] [--out tasks/chartf.pt]

A fixed seed and a time budget, as ``tasks.charlm_train``: it trains on random windows of the
corpus (``tasks.corpus``; the last 5% held out) of the model's whole context (256 characters,
so every learned position is trained) until the budget is spent, prints the held-out loss
(nats per character) as it goes, and saves float16 weights (about 1.6 MB).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from torch import nn

from tasks.charlm_train import corpus_ids
from tasks.chartf_model import WEIGHTS, CharTransformer, save

BATCH = 16
PEAK_LR = 3e-3
WARMUP_STEPS = 100


def batches(
    ids: torch.Tensor, window: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(ids) - window - 1, (BATCH,), generator=gen)
    rows = torch.stack([ids[s : s + window + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def loss_of(model: CharTransformer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def held_out_loss(model: CharTransformer, ids: torch.Tensor, gen: torch.Generator) -> float:
    with torch.no_grad():
        return float(loss_of(model, *batches(ids, model.context, gen)))


def train(minutes: float, threads: int, out: Path) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    ids = corpus_ids()
    cut = int(len(ids) * 0.95)
    train_ids, test_ids = ids[:cut], ids[cut:]
    print(f"corpus: {len(ids):,} characters ({len(train_ids):,} for training)")
    model = CharTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, weight_decay=0.01)
    started = time.monotonic()
    budget = minutes * 60
    step = 0
    while time.monotonic() - started < budget:
        # Warm-up, then cosine decay over the time budget rather than a step count: the
        # machine's speed varies.
        frac = (time.monotonic() - started) / budget
        lr = 1e-4 + (PEAK_LR - 1e-4) * 0.5 * (1 + math.cos(math.pi * frac))
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / WARMUP_STEPS)
        loss = loss_of(model, *batches(train_ids, model.context, gen))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
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
    parser.add_argument("--minutes", type=float, default=9.0, help="training time budget")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", type=Path, default=WEIGHTS)
    args = parser.parse_args()
    train(args.minutes, args.threads, args.out)


if __name__ == "__main__":
    main()
