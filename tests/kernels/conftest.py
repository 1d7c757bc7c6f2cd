"""Kernel tests: Triton runs on the CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before triton is first imported (the @triton.jit decorators
read it at import), so it is set here, when pytest loads this conftest, before the test
modules of this directory import the Triton backend.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # The interpreter evaluates masked-off lanes too (e.g. -inf - -inf on padded rows).
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")
