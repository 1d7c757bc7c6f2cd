"""Numerical parity of models/voxcpm2 with upstream OpenBMB/VoxCPM (the `voxcpm` wheel), tiny configs, float32."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path

import attrs
import pytest
import torch

from models.voxcpm2 import VoxCPM2Config, VoxCPM2Core, byte_tokenize, tiny_config, voxcpm2_config
from mtp_fsm._util.threads import torch_threads

TOL = 1e-5
# `make install` unpacks the pinned wheel there (Makefile: VOXCPM_DIR); VOXCPM_SRC overrides.
SRC = Path(os.environ.get("VOXCPM_SRC", Path(__file__).resolve().parents[2] / ".venv" / "upstream" / "voxcpm-src"))
FETCH_HINT = ("make install, or: pip download --no-deps voxcpm==2.0.3 -d /tmp/voxcpm_wheel && "
              "unzip -o /tmp/voxcpm_wheel/voxcpm-*.whl -d /tmp/voxcpm_src")
# Imported by upstream's voxcpm2.py but never reached by the code under test (audio file
# loading, the HF tokenizer, the progress bar): replaced by placeholders when not installed.
PLACEHOLDERS = {
    "librosa": {},
    "transformers": {"LlamaTokenizerFast": object, "PreTrainedTokenizer": object},
    "tqdm": {"tqdm": lambda iterable, **_: iterable},
}


def _load_upstream() -> types.ModuleType:
    """voxcpm.model.voxcpm2 from the unpacked wheel, without running the package __init__
    files (they import the audio stack and the CLI)."""
    pkg = SRC / "voxcpm"
    if not (pkg / "model" / "voxcpm2.py").exists():
        pytest.skip(f"upstream VoxCPM source not found at {SRC} (set VOXCPM_SRC, or: {FETCH_HINT})")
    missing = [m for m in ("pydantic", "einops", "numpy") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"upstream VoxCPM modules need packages missing from this venv: {missing}")
    if "voxcpm.model.voxcpm2" in sys.modules:
        return sys.modules["voxcpm.model.voxcpm2"]
    for name, path in (("voxcpm", pkg), ("voxcpm.model", pkg / "model")):
        stub = types.ModuleType(name)
        stub.__path__ = [str(path)]
        sys.modules[name] = stub
    if importlib.util.find_spec("transformers") is not None:
        importlib.import_module("transformers")  # before any placeholder: it probes optional packages
    placed = []
    for name, attrs_ in PLACEHOLDERS.items():
        if importlib.util.find_spec(name) is None:
            stub = types.ModuleType(name)
            stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
            stub.__dict__.update(attrs_)
            sys.modules[name] = stub
            placed.append(name)
    try:
        return importlib.import_module("voxcpm.model.voxcpm2")
    finally:
        for name in placed:  # upstream keeps its own reference; nothing else should see them
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def upstream():
    return _load_upstream()


VARIANTS = {
    # As released: no mup, short LongRoPE factors, residual LM without RoPE.
    "release": lambda: tiny_config(),
    # The other branches: mup scaling, the long factors with their attention factor, RoPE everywhere.
    "mup_longrope": lambda: tiny_config(
        lm_config=attrs.evolve(tiny_config().lm_config, use_mup=True, original_max_position_embeddings=64),
        residual_lm_no_rope=False),
}


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def build_pair(upstream, cfg: VoxCPM2Config, seed: int = 0):
    """Upstream VoxCPM2Model from our config.json (random init, norms perturbed), and ours with its
    state_dict copied by name."""
    up_cfg = upstream.VoxCPMConfig.model_validate(cfg.to_hf_dict())
    torch.manual_seed(seed)
    vae = types.SimpleNamespace(chunk_size=640, sample_rate=16000, latent_dim=cfg.feat_dim)
    ref = upstream.VoxCPM2Model(up_cfg, types.SimpleNamespace(vocab={}), vae, device="cpu").eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))  # ones by default would hide a misplaced norm
    ours = VoxCPM2Core(cfg, init_weights=False)
    theirs = ref.state_dict()
    assert set(theirs) == set(ours.module.state_dict())
    ours.module.load_state_dict(theirs, strict=True)
    return ref, ours


def prompt(cfg: VoxCPM2Config, audio_patches: int, seed: int = 3):
    """Upstream-layout inputs: text ids + audio-start, then (continuation mode) prompt patches."""
    ids = torch.tensor(byte_tokenize("Hi, VoxCPM!"))
    n_text, n = len(ids), len(ids) + audio_patches
    gen = torch.Generator().manual_seed(seed)
    feat = torch.zeros(1, n, cfg.patch_size, cfg.feat_dim)
    feat[0, n_text:] = torch.randn(audio_patches, cfg.patch_size, cfg.feat_dim, generator=gen)
    text = torch.cat((ids, torch.zeros(audio_patches, dtype=torch.long)))[None]
    audio_mask = (torch.arange(n) >= n_text).int()[None]
    return text, 1 - audio_mask, feat, audio_mask


def our_prefill(ours: VoxCPM2Core, text, text_mask, feat, audio_mask, slot: int = 1):
    is_audio = audio_mask[0].bool()
    rows = torch.where(is_audio[:, None], ours.next_embed(feat[0]), ours.prompt_embeds(text[0]))
    n = rows.shape[0]
    return ours.forward(rows, torch.arange(n), torch.full((n,), slot), is_audio)


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def test_config_keys_validate_upstream(upstream):
    for cfg in (voxcpm2_config(), tiny_config()):
        up = upstream.VoxCPMConfig.model_validate(cfg.to_hf_dict())
        dumped = up.model_dump()
        back = VoxCPM2Config.from_hf_dict({**dumped, "mtp_fsm": cfg.to_hf_dict()["mtp_fsm"]})
        assert back.lm_config == cfg.lm_config
        assert back.encoder_config == cfg.encoder_config
        assert attrs.evolve(back.dit_config, cfm_config=None) == attrs.evolve(cfg.dit_config, cfm_config=None)
        for key in ("patch_size", "feat_dim", "residual_lm_num_layers", "residual_lm_no_rope",
                    "scalar_quantization_latent_dim", "scalar_quantization_scale", "max_length"):
            assert getattr(back, key) == getattr(cfg, key), key


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_one_step_matches_upstream(upstream, variant):
    cfg = VARIANTS[variant]()
    ref, ours = build_pair(upstream, cfg)
    ours.bind_slots(2, torch.device("cpu"))
    hsz, diffs = cfg.hidden_size, {}
    text, text_mask, feat, audio_mask = prompt(cfg, audio_patches=2)
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
        x = torch.randn(5, hsz)
        fsq = ref.fsq_layer(x)
        patches = torch.randn(2, 3, cfg.patch_size, cfg.feat_dim)
        enc = ref.feat_encoder(patches)
    hidden = our_prefill(ours, text, text_mask, feat, audio_mask)
    diffs["base_lm hidden (text rows raw, audio rows FSQ)"] = maxdiff(hidden[:, :hsz], lm_out[0])
    diffs["residual_lm hidden"] = maxdiff(hidden[:, hsz:], res_out[0])
    diffs["stop logits"] = maxdiff(ours.stop_logits(hidden), stop)
    diffs["fsq"] = maxdiff(ours.module.fsq_layer(x), fsq)
    diffs["feat_encoder"] = maxdiff(ours.module.feat_encoder(patches, *ours._enc_rope), enc)

    # The DiT/CFM: upstream draws z = randn(b, D, P) itself; the same seed gives ours the same noise.
    mu = hidden[-2:]
    cond = torch.randn(2, cfg.patch_size, cfg.feat_dim)
    dit_mu = torch.cat((ref.lm_to_dit_proj(mu[:, :hsz]), ref.res_to_dit_proj(mu[:, hsz:])), -1)
    torch.manual_seed(11)
    want = ref.feat_decoder(mu=dit_mu, n_timesteps=cfg.inference_timesteps, patch_size=cfg.patch_size,
                            cond=cond.transpose(1, 2).contiguous(), cfg_value=cfg.cfg_value).transpose(1, 2)
    torch.manual_seed(11)
    noise = torch.randn(2, cfg.feat_dim, cfg.patch_size).transpose(1, 2)
    diffs["CFM patch (DiT + CFG)"] = maxdiff(ours.patch(mu, cond, noise), want)
    diffs["next_embed"] = maxdiff(ours.next_embed(patches[:, 0]),
                                  ref.enc_to_lm_proj(ref.feat_encoder(patches[:, :1]))[:, 0])
    print(f"\n[{variant}] max abs diff vs upstream:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert all(v <= TOL for v in diffs.values()), diffs


@pytest.mark.parametrize("audio_patches", [0, 2], ids=["zero_shot", "continuation"])
def test_decode_loop_matches_upstream_inference(upstream, audio_patches):
    """Upstream `_inference` (streaming) against our step functions for several patches, noise
    drawn in upstream's order; stop logits captured from upstream's stop_head."""
    cfg, steps = tiny_config(), 5
    ref, ours = build_pair(upstream, cfg, seed=1)
    ours.bind_slots(2, torch.device("cpu"))
    text, text_mask, feat, audio_mask = prompt(cfg, audio_patches)
    seen: list[torch.Tensor] = []
    handle = ref.stop_head.register_forward_hook(lambda mod, inp, out: seen.append(out.clone()))
    torch.manual_seed(5)
    want = [p.transpose(1, 2).clone() for p, _, _ in ref._inference(
        text, text_mask, feat, audio_mask, min_len=steps + 1, max_len=steps,
        inference_timesteps=cfg.inference_timesteps, cfg_value=cfg.cfg_value, streaming=True)]
    handle.remove()
    torch.manual_seed(5)
    noises = [torch.randn(1, cfg.feat_dim, cfg.patch_size).transpose(1, 2) for _ in range(steps)]

    hidden = our_prefill(ours, text, text_mask, feat, audio_mask)[-1:]
    prefix, n, worst = feat[:, -1], text.shape[1], {"patch": 0.0, "stop": 0.0}
    for i in range(steps):
        worst["stop"] = max(worst["stop"], maxdiff(ours.stop_logits(hidden), seen[i]))
        patch = ours.patch(hidden, prefix, noises[i])
        worst["patch"] = max(worst["patch"], maxdiff(patch, want[i]))
        prefix = patch
        hidden = ours.forward(ours.next_embed(patch), torch.tensor([n + i]), torch.tensor([1]),
                              torch.tensor([True]))
    print(f"\n[{steps} steps, {audio_patches} prompt patches] max abs diff vs upstream _inference:", worst)
    assert len(want) == len(seen) == steps
    assert all(v <= TOL for v in worst.values()), worst
