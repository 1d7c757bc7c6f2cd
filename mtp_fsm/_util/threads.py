"""torch intra-op thread pinning for a block of code, restored afterwards."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Run the block on n torch intra-op threads (n < 1: leave torch's setting), restoring the
    previous count after. Tiny tensors gain nothing from more threads: on a small shared
    machine the thread hand-offs cost far more than the arithmetic."""
    before = torch.get_num_threads()
    if n >= 1:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
