"""Serving tests run torch single-threaded: their tensors are tiny, and extra intra-op
threads only spin (badly so on a shared CI box), making the suite several times slower."""

import pytest

from mtp_fsm._util.threads import torch_threads


@pytest.fixture(autouse=True)
def _single_thread():
    with torch_threads(1):
        yield
