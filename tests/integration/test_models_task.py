"""tasks/models.py through a real worker: each text is scored by its batch key's model (the
base GRU with that key's adapter), checked against a reference that scores one text at a time
with the model's layers unbatched, and keys evicted and loaded again answer the same."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import queueserve as qs
from tasks.charlm_model import encode, load
from tasks.models import Adapters, adapter
from tests.support.helpers import WAIT_S

StartWorker = Callable[..., qs.Worker]
TEXTS = ["hello there", "the cat sat on the mat", "x", "Queues feed models."]


def reference(key: str, text: str) -> float:
    """One text alone: the GRU cell by cell, the key's adapter added to the output layer."""
    model = load()
    weight = model.head.weight + (adapter(key, model.hidden) if key != "base" else 0)
    ids = encode(text)
    if len(ids) < 2:
        return 0.0
    h = torch.zeros(1, 1, model.hidden)
    total = 0.0
    with torch.inference_mode():
        for prev, nxt in itertools.pairwise(ids):
            out, h = model.gru(model.embed(torch.tensor([[prev]])), h)
            logits = F.linear(out[0, 0], weight, model.head.bias)
            total += float(F.log_softmax(logits, dim=-1)[nxt])
    return total / (len(ids) - 1)


def test_each_text_is_scored_by_its_keys_model_through_a_worker(
    start_worker: StartWorker, client: qs.Client
) -> None:
    # Given the serving holding 2 models at most, and three keys' texts interleaved
    start_worker(Adapters(max_loaded_keys=2))
    keys = ["base", "acme", "globex", "acme", "base"]
    tickets = [(key, client.submit("adapters", TEXTS, batch_key=key)) for key in keys]
    # Then every answer is its key's model's (so the adapters differ), loads and evictions
    # between them included
    for key, ticket in tickets:
        got = ticket.result(WAIT_S)
        assert got == pytest.approx([reference(key, t) for t in TEXTS], abs=1e-4)
    assert reference("acme", TEXTS[0]) != pytest.approx(reference("base", TEXTS[0]), abs=1e-3)
