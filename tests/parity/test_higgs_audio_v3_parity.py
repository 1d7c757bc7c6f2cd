"""Higgs Audio v3 (models/higgs_audio_v3) vs vllm-omni 0.30.0's `HiggsAudioV3TalkerForConditionalGeneration`
and boson-multimodal 0.1.1's delay-pattern sampler.

Run by `make parity` in .venv-parity-omni, where both wheels are unpacked (never installed); elsewhere
the module skips, saying why. tests/parity/upstream_modules.py says what stands in for the vLLM
engine (the backbone is transformers 5.24.0's Qwen3Model in place of vLLM's); everything Higgs-
specific is upstream's file, unmodified.

Our tiny talker (weights redrawn for O(1) logits, the demo EOC wiring off) is saved with our
`save_checkpoint`; upstream's config class parses its config.json, upstream's real `__init__` builds
the talker and its `load_weights` loads the file (its key mapping, shape checks and required-key
check); our `load_checkpoint` loads the same file.

Greedy, one request, driven the way vLLM's runner drives upstream: per step the runner's
bookkeeping (`_last_step_input_ids`, the query start locations), `embed_input_ids` (the audio
feedback: the previous frame's fused embedding replaces the <|audio|> token's), the backbone,
`compute_logits`, the model-owned `sample` (all-greedy metadata; the text channel forced to
<|audio|>; per codebook the delay-pattern masks, argmax, and the delay / EOC wind-down state
update) and `postprocess` (the frame and its done flag). Ours: LockstepEngine with GREEDY. At frame
EOC_AT both sides get codebook 0's EOC logit raised (a forced stop); from there upstream's wind-
down runs: frame e + j locks codebooks 0..j-1 to EOC, the last frame (e + 7) keeps codebook 7's
code, and the request ends. Frames compared: all EOC_AT + 8, the raw fused-head logits of every
frame within 1e-5.

boson-multimodal 0.1.1 (the released Higgs Audio v2 generation code, which pins transformers
< 4.47 and so cannot be imported next to 5.24): its `HiggsAudioModel._sample_audio_tokens` is
compiled from the unpacked file alone (the function's own source, unmodified, with the names its
signature mentions) and run frame by frame on upstream v3's logits, greedy. Its rule sees raw
logits (v2 bans BOC / EOC elsewhere), so it gets them with BOC and EOC at -inf except the forced
EOC of codebook 0; its ramp-up, wind-down and end must produce the same frames.
"""

from __future__ import annotations

import ast
import json
import textwrap
import typing
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from parity_support import close, leading_same, record_greedy, record_load
from upstream_modules import boson_source, greedy_metadata, greedy_stock_sampler, vllm_omni_modules

TALKER = "Higgs Audio v3"
configs, talker_module = vllm_omni_modules("transformers_utils.configs.higgs_audio_v3",
                                           "model_executor.models.higgs_audio_v3.higgs_audio_v3_talker")
BOSON_MODELING = boson_source("model/higgs_audio/modeling_higgs_audio.py")

from models.higgs_audio_v3 import HiggsAudioV3Talker, HiggsInputs, load_checkpoint, save_checkpoint, tiny_config  # noqa: E402
from models.higgs_audio_v3.prompt import ByteTextTokenizer, prompt_ids  # noqa: E402
from mtp_fsm.engine import LockstepEngine, NewRequest  # noqa: E402
from mtp_fsm.sampling import GREEDY  # noqa: E402

EOC_AT = 24
TOL = 1e-5
FORCE = 1e4


@torch.no_grad()
def redraw(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)
        elif "modality_embeddings" in name:  # the audio table is the tied audio head too: logits O(3)
            p.copy_(3.0 * noise / p.shape[-1] ** 0.5)
        elif "embedding" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)


class Pair:
    def __init__(self, directory, seed: int = 7):
        cfg = tiny_config(batch_invariant=False, demo_eoc_wiring=False)
        ours = HiggsAudioV3Talker(cfg, seed=seed)
        redraw(ours.module, seed)
        self.directory = save_checkpoint(ours, directory / "tiny")
        self.config = cfg
        data = json.loads((self.directory / "config.json").read_text())
        self.upstream_config = configs.HiggsAudioV3Config(**data)
        vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=self.upstream_config, enforce_eager=True,
                                                                   model=None),
                                      compilation_config=None, scheduler_config=None)
        self.upstream = talker_module.HiggsAudioV3TalkerForConditionalGeneration(vllm_config=vllm_config).eval()
        self.upstream._stock_sampler = greedy_stock_sampler
        self.checkpoint = load_file(str(self.directory / "model.safetensors"))
        self.loaded = self.upstream.load_weights(iter(self.checkpoint.items()))
        self.ours = load_checkpoint(self.directory, dtype=torch.float32)
        self.inputs = HiggsInputs(text="Parity, please.")
        self.prompt = prompt_ids(cfg, ByteTextTokenizer().encode(self.inputs.text))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("higgs"))


def test_upstream_config_reads_our_config_json(pair):
    up, cfg = pair.upstream_config, pair.config
    assert (up.num_codebooks, up.codebook_size, up.audio_stream_bos_id, up.audio_stream_eos_id) == (
        cfg.num_codebooks, cfg.codebook_size, cfg.audio_stream_bos_id, cfg.audio_stream_eos_id)
    assert (talker_module.BOC_ID, talker_module.EOC_ID) == (cfg.audio_stream_bos_id, cfg.audio_stream_eos_id)
    assert up.tie_modality_embeddings and up.audio_hidden_size == cfg.hidden_size
    assert (up.tts_token_id, up.text_token_id, up.audio_continuation_id) == (
        cfg.tts_token_id, cfg.text_token_id, cfg.audio_continuation_id)
    text = up.text_config
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "rms_norm_eps", "vocab_size", "tie_word_embeddings"):
        assert getattr(text, name) == getattr(cfg, name), name
    assert (text.rope_parameters or {}).get("rope_theta", getattr(text, "rope_theta", None)) == cfg.rope_theta


def test_upstream_load_weights_takes_our_checkpoint(pair):
    """Upstream's loader maps every key (it raises on an unknown one), checks shapes and the
    required-key set; every upstream parameter must be filled, with our tensors."""
    up = pair.upstream
    params = {n for n, _ in up.named_parameters()}
    not_loaded = sorted(params - pair.loaded)
    required = up._build_required_keys(pair.config.num_hidden_layers)
    theirs = up.state_dict()
    ours = pair.ours.module.state_dict()
    differing = [k for k, v in ours.items() if not torch.equal(theirs[up._map_weight_name(k)], v)]
    ok = not not_loaded and required <= set(pair.checkpoint) and not differing
    record_load(TALKER, f"our checkpoint -> upstream HiggsAudioV3Talker.load_weights: {len(pair.loaded)} of "
                        f"{len(params)} parameters, {len(required)} required keys, bit-identical", ok,
                note=f"not loaded {not_loaded[:3]}, differing {differing[:3]}")
    assert not not_loaded, not_loaded
    assert not differing, differing[:5]


class UpstreamRun:
    """One request through upstream's hooks, as vLLM's runner calls them."""

    def __init__(self, pair: Pair, eoc_at: int | None):
        self.up, self.cfg = pair.upstream, pair.config
        self.eoc_at = eoc_at
        self.raw: list[torch.Tensor] = []
        original = self.up._audio_codebook_logits_from_rows

        def logits_from_rows(hidden, rows, *, all_rows=False):
            out = original(hidden, rows, all_rows=all_rows)
            self.raw.append(out[0].detach().clone())
            if self.eoc_at is not None and len(self.raw) - 1 == self.eoc_at:
                out[:, 0, self.cfg.audio_stream_eos_id] += FORCE  # the forced stop
            return out

        self.up._audio_codebook_logits_from_rows = logits_from_rows

    def close(self):
        del self.up._audio_codebook_logits_from_rows

    def step(self, ids: torch.Tensor, cache) -> tuple[torch.Tensor | None, bool, int]:
        up = self.up
        up._last_step_input_ids = ids
        up._set_last_step_query_start_loc(torch.tensor([0, ids.numel()], dtype=torch.int32))
        embeds = up.embed_input_ids(ids)
        hidden = up.model(inputs_embeds=embeds[None], cache=cache, use_cache=True).last_hidden_state[0, -1:]
        text_logits = up.compute_logits(hidden)
        out = up.sample(text_logits, greedy_metadata())
        token = int(out.sampled_token_ids.reshape(-1)[0])
        posted = up.postprocess(hidden)
        staging = up._last_audio_host_staging
        done = bool(staging is not None and staging[0, self.cfg.num_codebooks + 1])
        frame = posted["codes"]["audio"][0].long().clone() if posted else None
        return frame, done, token


@torch.inference_mode()
def upstream_greedy(pair: Pair, eoc_at: int | None, max_frames: int):
    import transformers

    run = UpstreamRun(pair, eoc_at)
    try:
        cache = transformers.DynamicCache()
        ids = torch.tensor(pair.prompt)
        frames = []
        for _ in range(max_frames + 1):
            frame, done, token = run.step(ids, cache)
            assert token == pair.config.audio_continuation_id
            if frame is not None:
                frames.append(frame)
            if done or len(frames) == max_frames:
                break
            ids = torch.tensor([token])
    finally:
        run.close()
    return torch.stack(frames), torch.stack(run.raw[: len(frames)]), done


def engine_greedy(pair: Pair, eoc_at: int | None, max_frames: int):
    model, cfg = pair.ours, pair.config
    raw: list[torch.Tensor] = []
    calls = {"cb0": 0}
    cb0_logits, audio_logits = model.cb0_logits, model.module.audio_logits

    def forced_cb0(hidden):
        logits = cb0_logits(hidden)
        if eoc_at is not None and calls["cb0"] == eoc_at:
            logits = logits.clone()
            logits[:, cfg.audio_stream_eos_id] += FORCE
        calls["cb0"] += 1
        return logits

    def all_logits(hidden, num_codebooks=None):
        out = audio_logits(hidden, num_codebooks)
        if num_codebooks is None:
            raw.append(out[0].detach().clone())
        return out

    model.cb0_logits, model.module.audio_logits = forced_cb0, all_logits
    engine = LockstepEngine(model, 1)
    try:
        out = engine.generate([NewRequest("r", pair.inputs, max_frames=max_frames, cb0_sampling=GREEDY,
                                          mtp_sampling=GREEDY)])
    finally:
        engine.close()
        del model.cb0_logits, model.module.audio_logits
    gen = out["r"]
    return torch.stack([f.codes for f in gen.frames]), torch.stack(raw), gen.finished


def test_engine_greedy_with_forced_wind_down_matches_upstream_sample(pair):
    cfg, q = pair.config, pair.config.num_codebooks
    ref, ref_raw, done = upstream_greedy(pair, EOC_AT, EOC_AT + 20)
    codes, raw, finished = engine_greedy(pair, EOC_AT, EOC_AT + 20)
    same = leading_same(codes, ref)
    record_greedy(TALKER, f"LockstepEngine vs upstream sample(), greedy, ramp-up + EOC forced at frame {EOC_AT} "
                          f"+ wind-down", same, max(len(codes), len(ref)))
    print(f"PARITY {TALKER} greedy + forced wind-down: {same} of {len(ref)} frames identical "
          f"(ours {len(codes)}, {finished.reason.name}; upstream done={done})")
    assert done and len(ref) == EOC_AT + q, f"upstream ended after {len(ref)} frames (done={done})"
    assert codes.shape == ref.shape and same == len(ref), f"first divergence at frame {same}"
    assert finished.reason.name == "EOS"
    # The wind-down as upstream writes it: frame e + j has codebooks 0..j-1 EOC (e + 1 repeats e's).
    eoc = cfg.audio_stream_eos_id
    for j in range(q):
        assert (ref[EOC_AT + j, : max(j, 1)] == eoc).all() and (ref[EOC_AT + j, max(j, 1):] != eoc).all()
    close(TALKER, raw, ref_raw, f"fused audio head logits, {len(ref)} frames x {q} codebooks", TOL)


def test_no_stop_run_matches_upstream(pair):
    ref, ref_raw, done = upstream_greedy(pair, None, EOC_AT + 8)
    codes, raw, finished = engine_greedy(pair, None, EOC_AT + 8)
    same = leading_same(codes, ref)
    record_greedy(TALKER, "LockstepEngine vs upstream sample(), greedy, no stop", same, max(len(codes), len(ref)))
    assert not done and finished.reason.name == "LENGTH"
    assert codes.shape == ref.shape and same == len(ref), f"first divergence at frame {same}"
    close(TALKER, raw, ref_raw, f"fused audio head logits, {len(ref)} frames (no stop)", TOL)


# ---------------------------------------------------------------- boson-multimodal's v2 sampler


def boson_sample_audio_tokens():
    """`HiggsAudioModel._sample_audio_tokens` compiled from boson-multimodal's file alone."""
    source = BOSON_MODELING.read_text()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "HiggsAudioModel":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "_sample_audio_tokens":
                    code = textwrap.dedent(ast.get_source_segment(source, item))
                    namespace = {"torch": torch, "nn": nn, **{k: getattr(typing, k) for k in typing.__all__},
                                 "LogitsProcessorList": object, "GenerationConfig": object}
                    exec(compile(code, f"{BOSON_MODELING}:_sample_audio_tokens", "exec"), namespace)
                    return namespace["_sample_audio_tokens"]
    raise AssertionError(f"_sample_audio_tokens not found in {BOSON_MODELING}")


def test_boson_multimodal_sampler_gives_the_same_frames(pair):
    cfg, q = pair.config, pair.config.num_codebooks
    sample = boson_sample_audio_tokens()
    ref, ref_raw, _ = upstream_greedy(pair, EOC_AT, EOC_AT + 20)
    boc, eoc, audio_eos = cfg.audio_stream_bos_id, cfg.audio_stream_eos_id, -1
    this = SimpleNamespace(config=SimpleNamespace(audio_out_token_idx=cfg.audio_continuation_id,
                                                  audio_stream_bos_id=boc, audio_stream_eos_id=eoc),
                           use_delay_pattern=True, audio_num_codebooks=q)
    generation = SimpleNamespace(generation_kwargs={"audio_eos_token_id": audio_eos})
    frames, num_delay, remaining, ended = [], 0, None, False
    for f in range(len(ref_raw)):
        logits = ref_raw[f].clone().float()
        logits[:, [boc, eoc]] = float("-inf")  # v2's rule sees no BOC / EOC candidates ...
        if f == EOC_AT:
            logits[0, eoc] = FORCE  # ... but the forced stop
        text, codes, _, _, num_delay, remaining = sample(
            this, None, logits[None], torch.stack(frames, 1) if frames else torch.zeros(q, 0, dtype=torch.long),
            False, lambda ids, scores: scores, torch.device("cpu"), None, generation, num_delay, remaining)
        frames.append(codes)
        if bool((text == audio_eos).all()):
            ended = True
            break
    boson = torch.stack(frames)
    same = leading_same(boson, ref)
    record_greedy(TALKER, f"boson-multimodal 0.1.1 _sample_audio_tokens on upstream v3's logits (EOC at "
                          f"{EOC_AT}) vs upstream v3 frames", same, max(len(boson), len(ref)))
    print(f"PARITY {TALKER} boson-multimodal sampler: {same} of {len(ref)} frames identical, ended={ended}")
    assert ended and boson.shape == ref.shape and same == len(ref), f"first divergence at frame {same}"
