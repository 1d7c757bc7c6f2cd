"""MtpLMTalker: a Qwen3 LM with a DeepSeek-V3-style MTP drafter, as an mtp_fsm TalkerModel (one token per frame)."""

from __future__ import annotations

import torch

from models.module_init import materialize, seeded_normal_init
from models.qwen3_tts.layers import Linear, RMSNorm, rope_tables
from models.slot_cache import PagedKVCache
from mtp_fsm import invariant
from mtp_fsm.model_api import DraftChooser, DraftInputs, ModelSpec, PreparedPrompt, TalkerModel

from .config import ByteTokenizer, MtpLMConfig, MtpLMInputs
from .model import MtpLMRoot

# Tiny-model wiring (see _wire_demo): three reserved residual channels, the constant every
# token carries, BOS's marker, and the EOS head's gain.
_CONST_DIM, _BOS_DIM, _PROGRESS_DIM = 0, 1, 2
_CONST_VALUE = 0.05
_BOS_VALUE = 1.0
_EOS_GAIN = 280.0
# Peaked, mostly bigram-like next-token distributions (so the drafter has something to
# predict and sampling is not uniform noise): the head's gain and the layers' output scale.
_HEAD_GAIN = 30.0
_LAYER_GAIN = 0.1


class MtpLMTalker(PagedKVCache, TalkerModel):
    """A Qwen3 decoder LM whose frame is one token, driven by the lockstep engine under the
    `single_codebook` lifecycle (forward / cb0_logits / frame_embed) or, with the engine's
    `speculate=k`, the `speculative` one with its MTP layer as the drafter (`draft`); the
    per-call pieces `embed`, `lm_logits`, `mtp_forward`, `mtp_logits` are public too (order
    and positions: this package's __init__).

    The slot KV cache holds num_hidden_layers + 1 layers: the backbone's, then the MTP
    layer's (its attention runs over the MTP's own states of the same request). Every method
    except `prepare` is batched and free of host syncs. `device="meta"` builds shapes only.
    """

    def __init__(self, config: MtpLMConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tokenizer=None, init_weights: bool = True):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.module = materialize(lambda: MtpLMRoot(config), dtype, self.device)
        if init_weights and self.device.type != "meta":
            self._init_weights(seed)
        if tokenizer is None and config.text_tokenizer == "bytes":
            tokenizer = ByteTokenizer()
        self.tokenizer = tokenizer
        self._cos, self._sin = rope_tables(config.max_context, config.head_dim, config.rope_theta,
                                           dtype, self.device)
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._spec = ModelSpec(
            name="mtp_lm", hidden_size=config.hidden_size, num_codebooks=1,
            backbone_vocab_size=config.vocab_size, codebook_size=config.codebook_size,
            eos_token_id=config.eos_token_id, max_context=config.max_context, dtype=dtype,
        )

    @property
    def spec(self) -> ModelSpec:  # type: ignore[override]
        return self._spec

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    # ---------------------------------------------------------------- weights

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """Deterministic from the seed alone (models.module_init)."""
        seeded_normal_init(self.module, seed, self.config.init_std, weights=(Linear, torch.nn.Embedding),
                           norms=(RMSNorm,))
        if self.config.demo_wiring:
            self._wire_demo()

    @torch.no_grad()
    def _wire_demo(self) -> None:
        """Tiny init only: an EOS that wins past a fixed position, and an MTP layer that drafts.

        EOS. With random weights EOS is one of ~257 near-equal logits. Three residual channels
        are reserved: no projection reads them and no layer output writes them, except that
        every embedding row carries CONST = _CONST_VALUE, BOS's row carries BOS = _BOS_VALUE,
        and one layer-0 head with a zero query (uniform attention over the row's own context
        [0, p]) reads BOS through its value and writes PROGRESS = CONST * (s + 1) / (p + 1),
        s = demo_stop_position (BOS sits at position 0 of every prompt). EOS's head row reads
        _EOS_GAIN * (CONST - PROGRESS), which the final norm only rescales: negative before
        position s, positive and growing after it (greedy: EOS at about s + 1; sampled at
        temperature 1: a few positions later). It depends only on the row's position.

        Peaked and predictable. The head is scaled by _HEAD_GAIN (random init leaves logits of
        std ~0.08: sampling would be uniform noise) and every layer's output projections by
        _LAYER_GAIN (PROGRESS's writer excepted), so the next token is mostly a function of
        the current one: a stand-in for a trained LM's predictability, which is what a
        drafter exploits.

        Drafter. The MTP layer at position p sees hnorm(backbone hidden at p) and
        enorm(embedding of token p + 1) and is scored against the backbone's prediction at
        p + 1, whose dominant inputs are that token's embedding and the layer stack over it.
        So eh_proj passes the embedding half through (scaled back to the embedding table's
        scale) and the hidden half's CONST and PROGRESS channels (PROGRESS shrunk by
        (s + 1) / (s + 2), one position's decay at the stop, so the drafted EOS agrees with
        the backbone's next one), and the MTP decoder layer starts as a copy of backbone
        layer 0: an honest one-layer drafter (its own attention over its own KV of the
        request's drafted positions), missing the backbone's later layers. Measured greedy
        draft agreement is in tests/models/test_mtp_lm.py.
        """
        m, cfg = self.module, self.config
        hidden, head_dim, stop = cfg.hidden_size, cfg.head_dim, cfg.demo_stop_position
        dims = [_CONST_DIM, _BOS_DIM, _PROGRESS_DIM]
        content = torch.ones(hidden, dtype=torch.bool)
        content[dims] = False
        emb = m.model.embed_tokens.weight
        emb[:, dims] = 0
        emb[:, _CONST_DIM] = _CONST_VALUE
        emb[cfg.bos_token_id, _BOS_DIM] = _BOS_VALUE
        for layer in m.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                lin.weight[:, dims] = 0
            attn.o_proj.weight[dims] = 0
            mlp.down_proj.weight[dims] = 0
        first = m.model.layers[0].self_attn
        first.q_proj.weight[:head_dim] = 0  # query head 0: zero query -> uniform attention
        first.v_proj.weight[0] = 0  # KV head 0, dim 0 reads only BOS
        first.v_proj.weight[0, _BOS_DIM] = 1.0
        # BOS's value is its marker after layer 0's input RMSNorm (weight 1): computed exactly.
        bos_row = emb[cfg.bos_token_id].float()
        bos_normed = _BOS_VALUE * torch.rsqrt(invariant.mean(bos_row * bos_row) + cfg.rms_norm_eps)
        first.o_proj.weight[_PROGRESS_DIM, 0] = _CONST_VALUE * (stop + 1) / bos_normed
        # The gain is _LAYER_GAIN at the tiny size (64 wide, 2 layers) and shrinks with width
        # and depth (measured: at 1024 x 6 a sqrt(width) rule left greedy drafts accepted 24%
        # of the time, this one 88%), so a wide model is as predictable as the tiny one.
        gain = _LAYER_GAIN * min(1.0, (64 / hidden) ** 1.5 * (2 / cfg.num_hidden_layers) ** 0.5)
        for layer in m.model.layers[: cfg.num_hidden_layers]:
            layer.mlp.down_proj.weight.mul_(gain)
            out = layer.self_attn.o_proj.weight
            progress = out[_PROGRESS_DIM].clone()
            out.mul_(gain)
            out[_PROGRESS_DIM] = progress
        head = m.lm_head.weight
        head.mul_(_HEAD_GAIN)
        head[:, dims] = 0
        head[cfg.eos_token_id] = 0
        head[cfg.eos_token_id, _CONST_DIM] = _EOS_GAIN
        head[cfg.eos_token_id, _PROGRESS_DIM] = -_EOS_GAIN
        # The drafter.
        mtp = m.mtp_layer
        for name, tensor in m.model.layers[0].state_dict().items():
            mtp.get_parameter(name).copy_(tensor)
        scale = emb.float().pow(2).mean().sqrt()  # enorm's output back to the table's scale
        proj = mtp.eh_proj.weight
        proj.zero_()
        proj[:, :hidden][content, content] = scale.to(proj.dtype)
        proj[_CONST_DIM, hidden + _CONST_DIM] = scale
        proj[_PROGRESS_DIM, hidden + _PROGRESS_DIM] = scale * (stop + 1) / (stop + 2)

    # ---------------------------------------------------------------- admission

    @torch.no_grad()
    def prepare(self, inputs: MtpLMInputs) -> PreparedPrompt:
        """Prompt embeddings [P, H] of [BOS (if the config has one), prompt ids]. Host side, once."""
        cfg = self.config
        if inputs.token_ids is not None:
            ids = list(inputs.token_ids)
        elif self.tokenizer is not None:
            ids = self.tokenizer.encode(inputs.text)
        else:
            raise ValueError("this config has no built-in tokenizer: pass MtpLMInputs(token_ids=...)")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocab [0, {cfg.vocab_size}): {bad[:8]}")
        ids = ([] if cfg.bos_token_id is None else [cfg.bos_token_id]) + ids
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= cfg.max_context:
            raise ValueError(f"prompt of {len(ids)} positions leaves no room in max_context {cfg.max_context}")
        return PreparedPrompt(prompt_embeds=self.embed(torch.tensor(ids, dtype=torch.long, device=self.device)))

    # ---------------------------------------------------------------- per-slot state

    def _kv_layout(self) -> tuple[int, int, int, int]:
        cfg = self.config
        return cfg.num_hidden_layers + 1, cfg.max_context, cfg.num_key_value_heads, cfg.head_dim

    # ---------------------------------------------------------------- engine hooks (single_codebook)

    def text_step(self, columns: dict[str, torch.Tensor], slots: torch.Tensor,
                  frame_index: torch.Tensor) -> torch.Tensor:
        """Zeros [B, H]: the text conditions generation only through the prompt."""
        return torch.zeros(slots.shape[0], self.config.hidden_size, dtype=self.dtype, device=slots.device)

    @torch.no_grad()
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                token_slots: torch.Tensor) -> torch.Tensor:
        """Backbone over flat tokens [T, H] at (slot, position) -> final-normed hidden [T, H].
        Padding tokens (slot -1) touch only the scratch row."""
        return self.module.backbone(inputs_embeds.to(self.dtype), positions.long(), token_slots.long(),
                                    self._require_cache(), self._cos, self._sin)

    @torch.no_grad()
    def cb0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_logits(hidden)

    @torch.no_grad()
    def frame_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """embed_tokens(codes[:, 0]) [B, H]: a gather, so a row's bits never depend on the batch."""
        return self.embed(codes[:, 0])

    @torch.no_grad()
    def draft(self, inputs: DraftInputs, choose: DraftChooser) -> torch.Tensor:
        """The MTP layer as the engine's drafter (vLLM's deepseek_mtp order): over every token
        of the step (the MTP KV follows the backbone's), then from each row's last accepted
        token, recycled for drafts 2..k at the positions the engine gives. -> [B, k]."""
        cache = self._require_cache()
        m = self.module.mtp(inputs.hidden.to(self.dtype), inputs.next_inputs.to(self.dtype), inputs.positions.long(),
                            inputs.token_slots.long(), cache, self._cos, self._sin)
        current = m[inputs.last]
        drafts = [choose(self.mtp_logits(current), 0)]
        for i in range(1, inputs.num_drafts):
            current = self.module.mtp(current, self.embed(drafts[-1]), inputs.chain_positions[:, i - 1].long(),
                                      inputs.chain_slots[:, i - 1].long(), cache, self._cos, self._sin)
            drafts.append(choose(self.mtp_logits(current), i))
        return torch.stack(drafts, dim=1)

    # ---------------------------------------------------------------- speculative decoding calls

    @torch.no_grad()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """embed_tokens [B] -> [B, H]; ids are clamped into the vocab (garbage stays in bounds)."""
        return self.module.model.embed_tokens(token_ids.long().clamp(0, self.config.vocab_size - 1))

    @torch.no_grad()
    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over forward()'s hidden: [B, V]."""
        return self.module.lm_head(hidden.to(self.dtype))

    @torch.no_grad()
    def mtp_forward(self, prev_hidden: torch.Tensor, next_token: torch.Tensor, positions: torch.Tensor,
                    token_slots: torch.Tensor) -> torch.Tensor:
        """The MTP layer over flat tokens, vLLM's convention: the row at position p takes the
        hidden state that predicted token p + 1 (forward()'s output at p, or for later draft
        steps this method's own output at p - 1) and token p + 1 itself; it writes the MTP KV
        at (slot, p) and returns [T, H], whose mtp_logits predict token p + 2. At p == 0 the
        token's embedding is zeroed (as vLLM does). Padding (slot -1) touches no slot."""
        embeds = self.embed(next_token)
        return self.module.mtp(prev_hidden.to(self.dtype), embeds, positions.long(), token_slots.long(),
                               self._require_cache(), self._cos, self._sin)

    @torch.no_grad()
    def mtp_logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """The shared head (lm_head) over mtp_forward()'s output (already shared_head-normed): [B, V]."""
        return self.module.lm_head(mtp_hidden.to(self.dtype))
