"""The `vllm.general_plugins` entry point: registers the talker architectures in every vLLM process."""

from __future__ import annotations

import torch

from .model_dir import ARCHITECTURE


class MtpFsmTalkerForTTS(torch.nn.Module):
    """The architecture name vLLM's frontend validates. It is never built under
    mtp_fsm's worker (which owns the talker); a stock vLLM runner that tries says why."""

    def __init__(self, *, vllm_config=None, prefix: str = "") -> None:
        raise RuntimeError(f"{ARCHITECTURE} runs only under worker_cls='mtp_fsm.vllm.worker.FsmWorker' (use "
                           "mtp_fsm.vllm.TalkerLLM, which sets it); a stock vLLM model runner cannot run a talker")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never built
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **_) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


def register() -> None:
    """Idempotent: vLLM loads general plugins in the frontend, the engine core and each worker."""
    from vllm import ModelRegistry

    from .mrv2.standin import register as register_mrv2

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:{ARCHITECTURE}")
    register_mrv2()  # Model Runner V2's stand-in, as a lazy import string
