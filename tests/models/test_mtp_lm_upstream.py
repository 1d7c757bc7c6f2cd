"""Numerical parity of the MTP LM: backbone vs HF Qwen3ForCausalLM, MTP layer vs vLLM's DeepSeek MTP forward and names.

The MTP reference: vLLM's `DeepSeekMultiTokenPredictorLayer` cannot be constructed on CPU
without a full VllmConfig (its decoder layer is DeepSeek-V2's MLA/MoE layer with attention
backends and parallel groups), so `test_mtp_layer_matches_vllm_forward` runs vLLM's own
(unbound) `DeepSeekMultiTokenPredictorLayer.forward` with stand-ins built from HF transformers
modules holding our weights (HF Qwen3RMSNorm for enorm / hnorm / shared_head, nn.Linear for
eh_proj, an HF Qwen3DecoderLayer returning vLLM's (hidden, residual) pair as mtp_block).
`test_mtp_layer_matches_restated_math` restates that forward from vLLM's source (independent
of vLLM's import) on the same HF modules. Names are checked with vLLM's own loader helpers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.mtp_lm import MtpLMTalker, save_checkpoint, shared_copies, tiny_config
from mtp_fsm.testing.alone import torch_threads

transformers = pytest.importorskip("transformers", reason="HF transformers is not installed")
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import (  # noqa: E402
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

TEXT = "Parity, please!"
N = tiny_config().num_hidden_layers  # the MTP layer's index


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def ours():
    """The tiny model with every norm gain random too, so a mis-mapped name shows. Without the
    demo wiring (an init only): its EOS gain makes logits ~100, where one float32 ulp is 1.5e-5."""
    model = MtpLMTalker(tiny_config(demo_wiring=False), seed=3)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.module.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    model.bind_slots(1, torch.device("cpu"))
    return model


def hf_config(model: MtpLMTalker) -> Qwen3Config:
    cfg = Qwen3Config(**model.config.to_hf_dict())
    cfg._attn_implementation = "eager"
    return cfg


def run_ours(model: MtpLMTalker, ids: list[int]):
    """Backbone over ids[:-1] and the MTP layer over (hidden at p, token p + 1), one slot."""
    model.reset_slots(torch.tensor([0]))
    n = len(ids) - 1
    pos, slot = torch.arange(n), torch.zeros(n, dtype=torch.long)
    hidden = model.forward(model.embed(torch.tensor(ids[:-1])), pos, slot)
    mtp = model.mtp_forward(hidden, torch.tensor(ids[1:]), pos, slot)
    return hidden, model.lm_logits(hidden), mtp, model.mtp_logits(mtp)


def prompt_ids(model, text=TEXT) -> list[int]:
    return [model.config.bos_token_id, *text.encode(), 97]  # a last token for the MTP's p + 1


def test_backbone_matches_hf_qwen3(ours):
    hf = Qwen3ForCausalLM(hf_config(ours)).float().eval()
    state = ours.module.state_dict()
    mtp_keys = {k for k in state if k.startswith(f"model.layers.{N}.")}
    # HF holds exactly our non-MTP tensors under the same names.
    assert set(hf.state_dict()) == set(state) - mtp_keys
    hf.load_state_dict({k: v for k, v in state.items() if k not in mtp_keys}, strict=True)
    ids = prompt_ids(ours)
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids[:-1]]), output_hidden_states=True)
    hidden, logits, _, _ = run_ours(ours, ids)
    diff = (logits - out.logits[0]).abs().max().item()
    hdiff = (hidden - out.hidden_states[-1][0]).abs().max().item()
    print(f"\nbackbone vs HF Qwen3ForCausalLM: logits max abs diff {diff:.2e}, hidden {hdiff:.2e} "
          f"over {len(ids) - 1} positions")
    assert diff <= 1e-5 and hdiff <= 1e-5


class _HFStandIn(nn.Module):
    """The attributes vLLM's DeepSeekMultiTokenPredictorLayer.forward reads, from HF modules."""

    def __init__(self, model: MtpLMTalker):
        super().__init__()
        cfg, state = hf_config(model), model.module.state_dict()
        prefix = f"model.layers.{N}."
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        eps = model.config.rms_norm_eps
        self.enorm, self.hnorm = Qwen3RMSNorm(cfg.hidden_size, eps), Qwen3RMSNorm(cfg.hidden_size, eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = Qwen3RMSNorm(cfg.hidden_size, eps)  # SharedHead.forward is its norm
        self.layer = Qwen3DecoderLayer(cfg, layer_idx=0)
        self.rotary = Qwen3RotaryEmbedding(cfg)
        for name, module in (("enorm", self.enorm), ("hnorm", self.hnorm), ("eh_proj", self.eh_proj),
                             ("shared_head.norm", self.shared_head)):
            module.load_state_dict({"weight": own.pop(f"{name}.weight")})
        self.layer.load_state_dict(own, strict=True)  # what is left: the decoder layer, HF names
        self.head = state["lm_head.weight"]  # shared_head.head == lm_head
        stand_in = self

        class Block:  # vLLM's decoder layer contract: (positions, hidden_states, residual) -> (out, residual)
            use_sequence_parallel_moe = False

            def __call__(self, positions, hidden_states, residual):
                assert residual is None
                x = hidden_states[None]
                t = x.shape[1]
                cos_sin = stand_in.rotary(x, positions[None])
                causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
                layer = stand_in.layer
                h = x + layer.self_attn(layer.input_layernorm(x), cos_sin, causal)[0]
                return layer.mlp(layer.post_attention_layernorm(h))[0], h[0]

        self.mtp_block = Block()

    def embed(self, model: MtpLMTalker, ids: list[int]) -> torch.Tensor:
        return model.module.model.embed_tokens.weight[torch.tensor(ids)]


def _reference_inputs(model: MtpLMTalker):
    ids = prompt_ids(model)
    n = len(ids) - 1
    hf = Qwen3ForCausalLM(hf_config(model)).float().eval()
    state = model.module.state_dict()
    hf.load_state_dict({k: v for k, v in state.items() if not k.startswith(f"model.layers.{N}.")})
    with torch.no_grad():
        prev = hf(input_ids=torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    # vLLM's proposer: input ids shifted left by one (token p + 1 at position p), positions and
    # target hidden states unshifted.
    return ids, torch.arange(n), prev


def _compare(model, ids, pre, post, what):
    _, _, mtp, mtp_logits = run_ours(model, ids)
    stand_in = _HFStandIn(model)
    ref_logits = post @ stand_in.head.T  # compute_logits: head(shared_head(pre))
    diff = max((mtp - post).abs().max().item(), (mtp_logits - ref_logits).abs().max().item(),
               (stand_in.shared_head(pre) - post).abs().max().item())
    print(f"\nMTP layer vs {what}: max abs diff {diff:.2e} (hidden and logits, {len(ids) - 1} positions)")
    assert diff <= 1e-5


def test_mtp_layer_matches_vllm_forward(ours):
    try:
        from vllm.model_executor.models.deepseek_mtp import DeepSeekMultiTokenPredictorLayer
    except Exception as exc:  # noqa: BLE001  (vLLM's import chain fails in many environment-specific ways)
        pytest.skip(f"vLLM's deepseek_mtp is not importable here: {exc!r}")
    ids, positions, prev = _reference_inputs(ours)
    stand_in = _HFStandIn(ours)
    with torch.no_grad():
        embeds = stand_in.embed(ours, ids[1:])
        pre, post = DeepSeekMultiTokenPredictorLayer.forward(stand_in, torch.tensor(ids[1:]), positions, prev,
                                                             inputs_embeds=embeds)
    _compare(ours, ids, pre, post, "vLLM DeepSeekMultiTokenPredictorLayer.forward")


def test_mtp_layer_matches_restated_math(ours):
    """vLLM deepseek_mtp.py, restated: emb zeroed at position 0; h = eh_proj(cat([enorm(emb),
    hnorm(prev)])); (out, res) = mtp_block(positions, h, None); pre = res + out; logits =
    shared_head.head(shared_head.norm(pre))."""
    ids, positions, prev = _reference_inputs(ours)
    s = _HFStandIn(ours)
    with torch.no_grad():
        emb = s.embed(ours, ids[1:]) * (positions != 0)[:, None]
        out, res = s.mtp_block(positions, s.eh_proj(torch.cat([s.enorm(emb), s.hnorm(prev)], -1)), None)
        pre = res + out
    _compare(ours, ids, pre, s.shared_head(pre), "restated vLLM math")


def test_checkpoint_names_match_vllm_loader(ours, tmp_path):
    """vLLM's own helpers place every MTP tensor of our checkpoint: get_spec_layer_idx_from_weight_name
    picks out exactly the `model.layers.N.*` keys, and DeepSeekMTP._rewrite_spec_layer_name maps
    them onto DeepSeekMultiTokenPredictorLayer's attributes (enorm, hnorm, eh_proj,
    shared_head.{norm,head}, mtp_block.<decoder layer>) and the shared embed_tokens."""
    try:
        from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP
        from vllm.model_executor.models.utils import get_spec_layer_idx_from_weight_name
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"vLLM's deepseek_mtp is not importable here: {exc!r}")
    from safetensors import safe_open

    save_checkpoint(ours, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
    cfg = hf_config(ours)
    spec = {k for k in keys if get_spec_layer_idx_from_weight_name(cfg, k) == N}
    assert spec == {k for k in keys if k.startswith(f"model.layers.{N}.")} and set(shared_copies(ours.config)) <= spec
    rewritten = {DeepSeekMTP._rewrite_spec_layer_name(None, N, k) for k in spec}
    p = f"model.layers.{N}."
    expected = {f"{p}enorm.weight", f"{p}hnorm.weight", f"{p}eh_proj.weight", f"{p}shared_head.norm.weight",
                f"{p}shared_head.head.weight", "model.embed_tokens.weight"}
    layer = {k[len(p):] for k in ours.module.state_dict() if k.startswith(p)} - {
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
    assert rewritten == expected | {f"{p}mtp_block.{k}" for k in layer}
