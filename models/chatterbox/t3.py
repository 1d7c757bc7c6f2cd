"""Chatterbox Turbo T3 modules with upstream parameter names (tfmr, cond_enc.spkr_enc, text/speech embeddings, speech_head)."""

from __future__ import annotations

import torch
from torch import nn

from .config import ChatterboxConfig
from .gpt2 import GPT2Backbone, Linear

# State-dict keys match `chatterbox.models.t3.t3.T3` as Turbo builds it (chatterbox-tts
# 0.1.7, `ChatterboxTurboTTS.from_local`): `tfmr.{wpe,h.*,ln_f}` (HF GPT2Model),
# `cond_enc.spkr_enc`, `text_emb`, `speech_emb`, `speech_head` (with bias: upstream gives
# the GPT-2 variant a biased head). Turbo has no perceiver, emotion_adv_fc or learned
# text/speech position tables (`input_pos_emb=None`). Not held: `tfmr.wte` (upstream
# deletes it after loading) and `text_head` (the training-only text loss head).


class T3CondEnc(nn.Module):
    """`cond_enc`: the speaker embedding projection (Turbo's only conditioning module)."""

    def __init__(self, cfg: ChatterboxConfig):
        super().__init__()
        self.spkr_enc = Linear(cfg.speaker_embed_size, cfg.hidden_size, True, cfg.batch_invariant)


class T3Turbo(nn.Module):
    """Root module: its state-dict keys are upstream T3's (minus `tfmr.wte` and `text_head`)."""

    def __init__(self, cfg: ChatterboxConfig):
        super().__init__()
        bi = cfg.batch_invariant
        self.tfmr = GPT2Backbone(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                                 cfg.intermediate_size, cfg.n_positions, cfg.layer_norm_epsilon,
                                 cfg.activation_function, bi)
        self.cond_enc = T3CondEnc(cfg)
        self.text_emb = nn.Embedding(cfg.text_tokens_dict_size, cfg.hidden_size)
        self.speech_emb = nn.Embedding(cfg.speech_tokens_dict_size, cfg.hidden_size)
        self.speech_head = Linear(cfg.hidden_size, cfg.speech_tokens_dict_size, True, bi)

    def speaker_embed(self, speaker_emb: torch.Tensor) -> torch.Tensor:
        """[speaker_embed_size] -> the prompt's first position [1, H]."""
        return self.cond_enc.spkr_enc(speaker_emb.reshape(1, -1))
