"""MOSS-TTS Local (models/moss_tts_local) vs vllm-omni 0.30.0's `MossTTSLocalTalkerForGeneration`.

Run by `make parity` in .venv-parity-omni, where the vllm-omni wheel is unpacked (never installed);
elsewhere the module skips, saying why. What is upstream and what stands in for the vLLM engine:
tests/parity/upstream_modules.py (the backbone is transformers 5.24.0's Qwen3Model in place of
vLLM's; everything MOSS-specific is vllm-omni's file, unmodified).

Our tiny talker (weights redrawn for O(1) logits, the demo stop wiring off) is saved with our
`save_checkpoint`; upstream's config class parses its config.json and upstream's real `__init__`
and `load_weights` load its tensors (every parameter, every checkpoint key used); our
`load_checkpoint` loads the same file. Greedy on both sides:

  upstream, as its runner drives it: `preprocess` (prefill: text embeddings + `_audio_embed` of
  the reference codes), the backbone, then per frame `talker_mtp(do_sample=False)` (the local
  depth transformer's `generate_frame`: binary continue/stop head and codebook heads at argmax;
  the next input is the assistant-slot embedding plus `_audio_embed` of the frame) until the
  binary head says stop;
  ours: LockstepEngine with codebook 0, the MTP codebooks and the binary stop head greedy (the
  model owns those samplings -- ModelSpec.cb0_sampling / mtp_sampling, STOP_SAMPLING, upstream's
  T 1.7 / top-k 25 / top-p 0.8 and T 1 -- so the test sets them to GREEDY, as upstream's
  do_sample=False does on its side).

Checked: codes of FRAMES frames identical, the logits of every head call (binary head, the 12
codebook heads) within 1e-5, and a forced stop (the binary head's stop logit raised at frame
STOP_AT on both sides) ending both after the same frames.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import attrs
import pytest
import torch
from safetensors.torch import load_file

from parity_support import close, leading_same, record_greedy, record_load
from upstream_modules import vllm_omni_modules

TALKER = "MOSS-TTS Local"
configuration, talker_module = vllm_omni_modules("model_executor.models.moss_tts.configuration_moss_tts",
                                                 "model_executor.models.moss_tts.modeling_moss_tts_talker")

import models.moss_tts_local.adapter as our_adapter  # noqa: E402
from models.moss_tts_local import MossInputs, MossTTSLocalTalker, load_checkpoint, save_checkpoint, tiny_config  # noqa: E402
from models.moss_tts_local.prompt import MossByteTokenizer, build_prompt_rows  # noqa: E402
from mtp_fsm.engine import LockstepEngine, NewRequest  # noqa: E402
from mtp_fsm.sampling import GREEDY  # noqa: E402

FRAMES = 24
STOP_AT = 26
TOL = 1e-5


@torch.no_grad()
def redraw(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if "norm" in name or ".ln_" in name or name.startswith("local_transformer.ln_f"):
            p.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        elif "embed" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)


class Pair:
    def __init__(self, directory, seed: int = 5):
        cfg = tiny_config(batch_invariant=False, demo_stop_wiring=False)
        ours = MossTTSLocalTalker(cfg, seed=seed)
        redraw(ours.module, seed)
        with torch.no_grad():  # the binary head leans to "continue": channel 0 of the local hidden is
            local = ours.module  # a constant 4 (ln_f weight 0, bias 4), read only by that head's rows
            local.local_transformer.ln_f.weight[0] = 0.0
            local.local_transformer.ln_f.bias[0] = 4.0
            local.local_text_lm_head.weight[:, 0] = torch.tensor([3.0, -3.0])
        self.directory = save_checkpoint(ours, directory / "tiny")
        self.config = cfg
        data = json.loads((self.directory / "config.json").read_text())
        self.upstream_config = configuration.MossTTSLocalConfig(**data)
        vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=self.upstream_config, enforce_eager=True))
        self.upstream = talker_module.MossTTSLocalTalkerForGeneration(vllm_config=vllm_config).eval()
        self.checkpoint = load_file(str(self.directory / "model.safetensors"))
        self.loaded = self.upstream.load_weights(iter(self.checkpoint.items()))
        self.ours = load_checkpoint(self.directory, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed + 1)
        reference = torch.randint(0, cfg.audio_vocab_size, (3, cfg.n_vq), generator=gen)
        self.inputs = MossInputs(text="Parity, please.", reference_codes=reference)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("moss"))


def test_upstream_config_reads_our_config_json(pair):
    up, cfg = pair.upstream_config, pair.config
    q, g = up.qwen3_config, up.gpt2_config
    assert (up.n_vq, up.audio_vocab_size, up.audio_pad_token_id) == (cfg.n_vq, cfg.audio_vocab_size, cfg.audio_pad_token_id)
    for name in ("im_start_token_id", "im_end_token_id", "audio_start_token_id", "audio_end_token_id",
                 "audio_user_slot_token_id", "audio_assistant_slot_token_id"):
        assert getattr(up, name) == getattr(cfg, name), name
    assert up.local_text_head_mode == "binary"
    for ours, theirs in (("hidden_size", "hidden_size"), ("num_hidden_layers", "num_hidden_layers"),
                         ("num_attention_heads", "num_attention_heads"), ("num_key_value_heads", "num_key_value_heads"),
                         ("head_dim", "head_dim"), ("intermediate_size", "intermediate_size"),
                         ("rms_norm_eps", "rms_norm_eps"), ("vocab_size", "vocab_size")):
        assert getattr(q, theirs) == getattr(cfg, ours), ours
    assert (q.rope_parameters or {}).get("rope_theta", getattr(q, "rope_theta", None)) == cfg.rope_theta
    assert (g.n_head, g.n_inner, g.layer_norm_epsilon, g.rope_base) == (
        cfg.local.num_attention_heads, cfg.local.intermediate_size, cfg.local.layer_norm_eps, cfg.local.rope_base)
    assert len(pair.upstream.local_transformer.h) == cfg.local.num_hidden_layers == 1


def test_upstream_load_weights_takes_every_tensor_of_our_checkpoint(pair):
    params = {n for n, _ in pair.upstream.named_parameters()}
    not_loaded = sorted(params - pair.loaded)
    # Every checkpoint key lands somewhere (the backbone's under model.*).
    unused = sorted(k for k in pair.checkpoint
                    if (f"model.{k.removeprefix('transformer.')}" if k.startswith("transformer.") else k) not in pair.loaded)
    theirs = pair.upstream.state_dict()
    ours = pair.ours.module.state_dict()
    differing = [k for k, v in ours.items()
                 if not torch.equal(theirs[f"model.{k.removeprefix('transformer.')}" if k.startswith("transformer.") else k], v)]
    ok = not not_loaded and not unused and not differing
    record_load(TALKER, f"our checkpoint -> upstream MossTTSLocalTalkerForGeneration.load_weights: "
                        f"{len(pair.loaded)} of {len(params)} parameters, bit-identical", ok,
                note=f"not loaded {not_loaded[:3]}, unused keys {unused[:3]}, differing {differing[:3]}")
    assert not not_loaded, f"upstream parameters our checkpoint does not fill: {not_loaded}"
    assert not unused, f"checkpoint keys upstream's loader skips: {unused}"
    assert not differing, differing[:5]


class HeadLog:
    """Forward hooks on the heads both sides share by name: every call's output, per head."""

    def __init__(self, root: torch.nn.Module, n_vq: int, stop_at: int | None = None):
        self.calls: dict[str, list[torch.Tensor]] = {}
        self.handles = []
        self.stop_at = stop_at
        for q in range(n_vq):
            self._hook(root.audio_lm_heads[q], f"audio_lm_heads.{q}")
        self._hook(root.local_text_lm_head, "local_text_lm_head")

    def _hook(self, module, name):
        def hook(mod, args, out):
            seen = self.calls.setdefault(name, [])
            if name == "local_text_lm_head" and self.stop_at is not None and len(seen) == self.stop_at:
                out = out.clone()
                out[..., 1] += 100.0  # force "stop" at this frame
            seen.append(out.detach().clone().float())
            return out

        self.handles.append(module.register_forward_hook(hook))

    def close(self):
        for h in self.handles:
            h.remove()


@torch.inference_mode()
def upstream_greedy(pair: Pair, frames: int, stop_at: int | None = None):
    cfg, up = pair.config, pair.upstream
    ids, codes = build_prompt_rows(cfg, pair.inputs, MossByteTokenizer())
    ids_t = torch.tensor(ids)
    log = HeadLog(up, cfg.n_vq, stop_at)
    try:
        _, embeds, _ = up.preprocess(ids_t, None, codes={"ref": codes}, _omni_is_prefill=True)
        cache = __import__("transformers").DynamicCache()
        hidden = up.model(inputs_embeds=embeds[None], cache=cache, use_cache=True).last_hidden_state[0, -1:]
        slot = torch.tensor([cfg.audio_assistant_slot_token_id])
        out = []
        for _ in range(frames + 1):
            text_embed = up.embed_input_ids(slot)
            embeds, frame = up.talker_mtp(slot, text_embed, hidden, torch.ones(1, 1), do_sample=False)
            if bool((frame == cfg.audio_pad_token_id).all()):
                break  # the binary head said stop: no frame; compute_logits would force im_end
            out.append(frame[0].clone())
            if len(out) == frames:
                break
            hidden = up.model(inputs_embeds=embeds[None], cache=cache,
                              use_cache=True).last_hidden_state[0, -1:]
    finally:
        log.close()
    return torch.stack(out), log.calls


def engine_greedy(pair: Pair, frames: int, stop_at: int | None = None):
    model, cfg = pair.ours, pair.config
    # The audio sampling is model-owned (ModelSpec.cb0_sampling / mtp_sampling: upstream's
    # T 1.7, top-k 25, top-p 0.8, which a request cannot override); greedy here, as upstream's
    # do_sample=False makes its side.
    model._spec = attrs.evolve(model.spec, cb0_sampling=GREEDY, mtp_sampling=GREEDY)
    log = HeadLog(model.module, cfg.n_vq, stop_at)
    engine = LockstepEngine(model, 1)
    try:
        out = engine.generate([NewRequest("r", pair.inputs, max_frames=frames, cb0_sampling=GREEDY,
                                          mtp_sampling=GREEDY)])
    finally:
        engine.close()
        log.close()
    gen = out["r"]
    assert gen.frames, f"our engine published no frame: {gen.finished}"
    return torch.stack([f.codes for f in gen.frames]), log.calls, gen.finished


@pytest.fixture
def greedy_stop(monkeypatch):
    # Upstream's do_sample=False takes the binary head's argmax; ours samples it with model-owned
    # parameters (STOP_SAMPLING): greedy here so both sides are deterministic.
    monkeypatch.setattr(our_adapter, "STOP_SAMPLING", attrs.evolve(GREEDY))


def compare_heads(ours: dict, theirs: dict, steps: int, tag: str) -> None:
    for name in sorted(theirs):
        a, b = torch.cat(ours[name][:steps]), torch.cat(theirs[name][:steps])
        close(TALKER, a, b, f"{name} logits, {steps} frames ({tag})", TOL)


def test_engine_greedy_matches_upstream_talker_mtp(pair, greedy_stop):
    ref, ref_logits = upstream_greedy(pair, FRAMES)
    codes, logits, finished = engine_greedy(pair, FRAMES)
    same = leading_same(codes, ref)
    record_greedy(TALKER, "LockstepEngine vs upstream talker_mtp / generate_frame, greedy", same, max(len(codes), len(ref)))
    print(f"PARITY {TALKER} greedy: {same} of {len(ref)} frames identical ({len(codes)} ours)")
    assert len(ref) == FRAMES, f"upstream stopped after {len(ref)} frames: pick another seed"
    assert codes.shape == ref.shape and same == FRAMES, f"first divergence at frame {same}"
    assert finished.reason.name == "LENGTH"
    compare_heads(logits, ref_logits, FRAMES, "greedy")


def test_forced_stop_ends_both_after_the_same_frames(pair, greedy_stop):
    ref, ref_logits = upstream_greedy(pair, STOP_AT + 10, stop_at=STOP_AT)
    codes, logits, finished = engine_greedy(pair, STOP_AT + 10, stop_at=STOP_AT)
    same = leading_same(codes, ref)
    record_greedy(TALKER, f"forced stop (binary head) at frame {STOP_AT}: frames before it", same,
                  max(len(codes), len(ref)))
    print(f"PARITY {TALKER} forced stop: upstream {len(ref)} frames, ours {len(codes)} ({finished.reason.name})")
    assert len(ref) == STOP_AT and codes.shape == ref.shape and same == STOP_AT
    assert finished.reason.name == "EOS"
    compare_heads(logits, ref_logits, STOP_AT + 1, "forced stop")
