"""VoxCPM2 (models/voxcpm2) vs voxcpm 2.0.3's model modules, for `make parity`'s table.

The comparison itself lives in tests/models/test_voxcpm2_upstream.py (the main suite runs it against
the wheel `make install` unpacks); this module runs the same construction (its helpers, imported)
in .venv-parity against the wheel that venv's target unpacks (.venv-parity/upstream/voxcpm-src,
never installed), records every difference in the parity table, and runs the decode loop for
STEPS patches. Outside `make parity` (PARITY_RESULTS unset) it skips: the main suite already runs
those checks.

Checked, float32, tiny configs (the released shape, and mup + long RoPE factors + RoPE everywhere):
  * config.json validated by upstream's `VoxCPMConfig` and read back;
  * upstream's state dict loads strictly into ours (same names; `build_pair`);
  * one step: base LM hidden (text rows raw, audio rows through FSQ), residual LM hidden, stop
    logits, FSQ, the local encoder, the CFM patch (DiT + CFG) from the same noise, next_embed;
  * upstream's streaming `_inference` for STEPS patches (zero-shot and continuation prompts): every
    patch from the same noise and every stop-head logit, and the stop decision (argmax, greedy on
    both sides) of every step identical.
Not through LockstepEngine: its noise is counter-based per (seed, frame) (so patches never depend
on the batch), upstream draws `torch.randn` inside its CFM; the step functions compared here are
the ones the engine's hooks call.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from parity_support import close, in_parity_run, record_greedy, record_load, upstream_dir

TALKER = "VoxCPM2"
STEPS = 24
TOL = 1e-5

if not in_parity_run():
    pytest.skip("VoxCPM2 parity runs under `make parity` (PARITY_RESULTS set); the main suite runs "
                "tests/models/test_voxcpm2_upstream.py", allow_module_level=True)
os.environ.setdefault("VOXCPM_SRC", str(upstream_dir("voxcpm-src")))

_SHARED = Path(__file__).resolve().parents[1] / "models" / "test_voxcpm2_upstream.py"
_spec = importlib.util.spec_from_file_location("_voxcpm2_upstream_checks", _SHARED)
shared = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = shared
_spec.loader.exec_module(shared)

_one_thread = shared._one_thread  # the shared module's autouse fixture: one torch thread
upstream = shared.upstream


def test_config_keys_validate_upstream(upstream):
    shared.test_config_keys_validate_upstream(upstream)
    record_load(TALKER, "our config.json -> upstream VoxCPMConfig.model_validate, read back", True)


@pytest.mark.parametrize("variant", sorted(shared.VARIANTS))
def test_one_step_matches_upstream(upstream, variant):
    cfg = shared.VARIANTS[variant]()
    ref, ours = shared.build_pair(upstream, cfg)  # asserts the same state-dict names, loads strictly
    if variant == "release":
        record_load(TALKER, "upstream VoxCPM2Model state dict -> ours, strict (same names)", True)
    ours.bind_slots(2, torch.device("cpu"))
    hsz = cfg.hidden_size
    text, text_mask, feat, audio_mask = shared.prompt(cfg, audio_patches=2)
    tm, am = text_mask[..., None], audio_mask[..., None]
    with torch.inference_mode():
        feat_embed = ref.enc_to_lm_proj(ref.feat_encoder(feat))
        scale = cfg.lm_config.scale_emb if cfg.lm_config.use_mup else 1.0
        combined = tm * ref.base_lm.embed_tokens(text) * scale + am * feat_embed
        lm_raw, _ = ref.base_lm(inputs_embeds=combined, is_causal=True)
        lm_out = ref.fsq_layer(lm_raw) * am + lm_raw * tm
        res_out, _ = ref.residual_lm(inputs_embeds=ref.fusion_concat_proj(torch.cat((lm_out, am * feat_embed), -1)),
                                     is_causal=True)
        stop = ref.stop_head(ref.stop_actn(ref.stop_proj(lm_out[0])))
        patches = torch.randn(2, 3, cfg.patch_size, cfg.feat_dim)
        enc = ref.feat_encoder(patches)
    hidden = shared.our_prefill(ours, text, text_mask, feat, audio_mask)
    close(TALKER, hidden[:, :hsz], lm_out[0], f"[{variant}] base LM hidden (text rows raw, audio rows FSQ)", TOL)
    close(TALKER, hidden[:, hsz:], res_out[0], f"[{variant}] residual LM hidden", TOL)
    close(TALKER, ours.stop_logits(hidden), stop, f"[{variant}] stop logits", TOL)
    close(TALKER, ours.module.feat_encoder(patches, *ours._enc_rope), enc, f"[{variant}] local encoder", TOL)
    mu = hidden[-2:]
    cond = torch.randn(2, cfg.patch_size, cfg.feat_dim)
    dit_mu = torch.cat((ref.lm_to_dit_proj(mu[:, :hsz]), ref.res_to_dit_proj(mu[:, hsz:])), -1)
    torch.manual_seed(11)
    want = ref.feat_decoder(mu=dit_mu, n_timesteps=cfg.inference_timesteps, patch_size=cfg.patch_size,
                            cond=cond.transpose(1, 2).contiguous(), cfg_value=cfg.cfg_value).transpose(1, 2)
    torch.manual_seed(11)
    noise = torch.randn(2, cfg.feat_dim, cfg.patch_size).transpose(1, 2)
    close(TALKER, ours.patch(mu, cond, noise), want, f"[{variant}] CFM patch (DiT + CFG)", TOL)
    close(TALKER, ours.next_embed(patches[:, 0]), ref.enc_to_lm_proj(ref.feat_encoder(patches[:, :1]))[:, 0],
          f"[{variant}] next_embed", TOL)


@pytest.mark.parametrize("audio_patches", [0, 2], ids=["zero_shot", "continuation"])
def test_decode_loop_matches_upstream_inference(upstream, audio_patches):
    cfg = shared.tiny_config()
    ref, ours = shared.build_pair(upstream, cfg, seed=1)
    ours.bind_slots(2, torch.device("cpu"))
    text, text_mask, feat, audio_mask = shared.prompt(cfg, audio_patches)
    seen: list[torch.Tensor] = []
    handle = ref.stop_head.register_forward_hook(lambda mod, inp, out: seen.append(out.clone()))
    torch.manual_seed(5)
    want = [p.transpose(1, 2).clone() for p, _, _ in ref._inference(
        text, text_mask, feat, audio_mask, min_len=STEPS + 1, max_len=STEPS,
        inference_timesteps=cfg.inference_timesteps, cfg_value=cfg.cfg_value, streaming=True)]
    handle.remove()
    torch.manual_seed(5)
    noises = [torch.randn(1, cfg.feat_dim, cfg.patch_size).transpose(1, 2) for _ in range(STEPS)]
    assert len(want) == len(seen) == STEPS
    hidden = shared.our_prefill(ours, text, text_mask, feat, audio_mask)[-1:]
    prefix, n = feat[:, -1], text.shape[1]
    patches, stops = [], []
    for i in range(STEPS):
        stops.append(ours.stop_logits(hidden))
        patch = ours.patch(hidden, prefix, noises[i])
        patches.append(patch)
        prefix = patch
        hidden = ours.forward(ours.next_embed(patch), torch.tensor([n + i]), torch.tensor([1]), torch.tensor([True]))
    tag = f"{audio_patches} prompt patches"
    close(TALKER, torch.cat(stops), torch.cat(seen), f"_inference stop logits, {STEPS} steps ({tag})", TOL)
    close(TALKER, torch.cat(patches), torch.cat(want), f"_inference patches, {STEPS} steps ({tag})", TOL)
    ours_stop, ref_stop = torch.cat(stops).argmax(-1), torch.cat(seen).argmax(-1)
    same = int((ours_stop == ref_stop).cumprod(0).sum())
    record_greedy(TALKER, f"stop-head decisions (argmax) of upstream _inference's {STEPS} steps ({tag}); "
                          f"patches within {TOL:g}", same, STEPS)
    assert same == STEPS
