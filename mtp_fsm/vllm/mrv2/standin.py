"""The nn.Module vLLM builds under Model Runner V2: a forward-free stand-in whose ModelState runs the talker."""

from __future__ import annotations

from pathlib import Path

import torch

from ...model_api import TalkerModel
from ..model_dir import TalkerDirConfig, write_model_dir

ARCHITECTURE = "MtpFsmTalkerMRV2"
MODULE_CLASS = f"{__name__}:FsmTalkerStandIn"


class FsmTalkerStandIn(torch.nn.Module):
    """What vLLM's MRV2 runner loads for a talker (architecture MtpFsmTalkerMRV2).

    It has no parameters, buffers or attention layers (the talker's weights and per-slot
    KV live in the LockstepEngine that FsmModelState builds), so vLLM's dummy loader
    touches nothing and vLLM keeps no KV cache for it (attention-free: vLLM never preempts
    for KV; the engine's slot table bounds concurrency through `max_num_seqs`). Its
    forward returns the `inputs_embeds` FsmModelState passes (a persistent zero buffer)
    as the hidden states, so vLLM's forward and CUDA graphs cost nothing; its logits are
    zeros the FsmSampler never reads.
    """

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        self.talker_config = TalkerDirConfig.from_hf_config(hf_config)
        self.vocab_size = int(hf_config.vocab_size)
        self.hidden_size = int(vllm_config.model_config.get_inputs_embeds_size())

    @staticmethod
    def get_model_state_cls():
        """MRV2's hook (`resolve_model_state_cls`): this makes the architecture MRV2-only."""
        from .model_state import FsmModelState

        return FsmModelState

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.hidden_size, device=input_ids.device)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **_) -> torch.Tensor:
        if inputs_embeds is None:
            raise RuntimeError(f"{ARCHITECTURE} runs only with FsmModelState (its prepare_inputs passes the "
                               "inputs_embeds buffer); was the model state replaced?")
        return inputs_embeds[: positions.shape[-1]]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.new_zeros(hidden_states.shape[0], self.vocab_size)


def write_mrv2_model_dir(directory: str | Path, config: TalkerDirConfig, model: TalkerModel) -> Path:
    """The model directory (mtp_fsm.vllm.write_model_dir) naming the MRV2 stand-in architecture."""
    return write_model_dir(directory, config, model, architecture=ARCHITECTURE)


def register(in_process: bool = False) -> None:
    """Register the architecture with vLLM (idempotent). in_process=True registers the class
    itself (no inspection subprocess; only this process knows it); False registers the lazy
    import string, which a `vllm.general_plugins` entry point can run in every process."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, FsmTalkerStandIn if in_process else MODULE_CLASS)
