"""What the peers' servers share: their command line, one torch thread, and the answer body."""

from __future__ import annotations

import argparse
import os
from typing import Any


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True, help="the all-MiniLM-L6-v2 directory")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--batch", type=int, default=32, help="largest batch the model runs")
    p.add_argument("--wait", type=float, default=0.010, help="seconds a batch waits to fill")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the replica")
    return p.parse_args()


def load_model(path: str, threads: int) -> Any:
    """sentence-transformers on the CPU with ``threads`` torch threads, offline: what a user of
    these servers writes."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    return SentenceTransformer(path, device="cpu")


def texts_of(body: dict[str, Any]) -> list[str]:
    """The texts of an OpenAI embeddings body: ``input`` is one string or a list of them."""
    texts = body["input"]
    return [texts] if isinstance(texts, str) else list(texts)


def answer(model: str, vectors: list[list[float]]) -> dict[str, Any]:
    """OpenAI's embeddings answer (what Infinity and the queueserve gateway send too)."""
    return {
        "object": "list",
        "model": model,
        "data": [
            {"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": 0, "total_tokens": 0},
    }
