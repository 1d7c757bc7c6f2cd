"""One kernel per transition stage; `select_backend` picks torch (reference), compiled torch or Triton."""

from __future__ import annotations

import types

import torch

from ..errors import KernelBackendError
from . import reference
from .contract import ReplayFrames, StagedAdmits, StagedEvents, StepBatch

BACKENDS = ("torch", "compiled", "triton", "auto")


def select_backend(kernels: str, device: torch.device) -> types.ModuleType:
    """The module whose stage functions the engine calls (same names, same contract)."""
    if kernels not in BACKENDS:
        raise KernelBackendError(f"unknown kernel backend {kernels!r}; choose one of {BACKENDS}")
    if kernels == "torch" or (kernels == "auto" and device.type != "cuda"):
        return reference
    if kernels == "compiled":  # imported on demand: torch.compile wrappers are built at import
        from . import compiled

        return compiled
    try:
        from . import triton_kernels
    except ImportError as exc:  # triton missing, or the Triton backend not built for this install
        if kernels == "auto":
            return reference
        raise KernelBackendError(f"kernels='triton' requested but Triton is unavailable: {exc}") from exc
    problem = triton_kernels.unsupported(device)
    if problem is not None:  # e.g. a CPU device without TRITON_INTERPRET=1 (set before triton is imported)
        if kernels == "auto":
            return reference
        raise KernelBackendError(f"kernels='triton' cannot run on {device}: {problem}")
    return triton_kernels


__all__ = ["BACKENDS", "select_backend", "reference", "ReplayFrames", "StagedAdmits", "StagedEvents", "StepBatch"]
