"""A serving that answers with the torch threads of the partition that ran it, for the worker's
option-effect table (``--torch-threads``; tests/integration/test_worker_option_effects.py).
Its own module: importing torch costs a second, which the other support apps need not pay."""

from __future__ import annotations

from typing import Any

import torch

import queueserve as qs


def _threads(items: list[Any]) -> list[int]:
    return [torch.get_num_threads()] * len(items)


threads = qs.Serving(_threads, name="threads", batch_size=8, batch_timeout=0)
