"""Serving tests run torch single-threaded: their tensors are tiny, and extra intra-op
threads only spin (badly so on a shared CI box), making the suite several times slower."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
