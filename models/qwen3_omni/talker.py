"""Qwen3-Omni talker modules (MoE backbone, text/hidden projections, CB0 head, code predictor) with upstream names.

State-dict keys (under the `talker.` root) match `Qwen3OmniMoeTalkerForConditionalGeneration`
in HF transformers `models/qwen3_omni_moe/modeling_qwen3_omni_moe.py`, with the experts in
the released checkpoints' per-expert layout (`mlp.experts.{e}.gate_proj.weight`, ...):
`model.{layers,norm,codec_embedding}`, `text_projection`, `hidden_projection`, `codec_head`,
`code_predictor.{model,lm_head}`.
"""

from __future__ import annotations

from torch import nn

from models.qwen3_tts.layers import Linear, RMSNorm
from models.qwen3_tts.talker import CodePredictor, Qwen3TTSTalkerModel, ResizeMLP

from .config import Qwen3OmniConfig
from .layers import MoeDecoderLayer


class Qwen3OmniTalkerModel(nn.Module):
    """`talker.model`: the MoE decoder stack, final norm and the CB0 codec embedding (no text embedding:
    the text side comes from the thinker, through text_projection)."""

    def __init__(self, cfg: Qwen3OmniConfig):
        super().__init__()
        self.layers = nn.ModuleList(
            MoeDecoderLayer(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                            cfg.rms_norm_eps, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                            cfg.shared_expert_intermediate_size, cfg.norm_topk_prob, cfg.batch_invariant)
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    # Flat tokens over the per-slot KV cache, exactly as the Qwen3-TTS backbone: it only uses
    # self.layers (called as layer(x, attend)) and self.norm, which this class provides.
    forward = Qwen3TTSTalkerModel.forward


class Qwen3OmniTalkerForGeneration(nn.Module):
    """`talker`: backbone, thinker-row projections, CB0 head (`codec_head`) and the code predictor.

    text_projection maps thinker *input embeddings* (text tokens, tts_* specials) and
    hidden_projection maps thinker hidden states of layer `accept_hidden_layer` (multimodal
    positions of the user turn) into the talker's hidden size; both are
    Linear(thinker_hidden, intermediate) -> SiLU -> Linear(intermediate, hidden) with biases.
    """

    def __init__(self, cfg: Qwen3OmniConfig):
        super().__init__()
        bi = cfg.batch_invariant
        self.model = Qwen3OmniTalkerModel(cfg)
        self.text_projection = ResizeMLP(cfg.thinker_hidden_size, cfg.intermediate_size, cfg.hidden_size, bi)
        self.hidden_projection = ResizeMLP(cfg.thinker_hidden_size, cfg.intermediate_size, cfg.hidden_size, bi)
        self.codec_head = Linear(cfg.hidden_size, cfg.vocab_size, False, bi)
        # talker hidden == predictor hidden, so small_to_mtp_projection is Identity (no weights), as upstream.
        self.code_predictor = CodePredictor(cfg.code_predictor, cfg.hidden_size, bi)


class Qwen3OmniRoot(nn.Module):
    """Root so state-dict keys carry upstream's `talker.` prefix (thinker and code2wav not included)."""

    def __init__(self, cfg: Qwen3OmniConfig):
        super().__init__()
        self.talker = Qwen3OmniTalkerForGeneration(cfg)

