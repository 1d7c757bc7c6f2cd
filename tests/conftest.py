"""The whole suite: Triton runs on the CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before triton is first imported (triton reads it then: a
@triton.jit helper decorated in compiled mode cannot be called from an interpreted kernel), so
it is set in the root conftest, which pytest loads before it collects any test module: a test
module that imports vLLM (which imports triton) at collection must not come first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # The interpreter evaluates masked-off lanes too (e.g. -inf - -inf on padded rows).
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")
