"""Qwen3-Omni (models/qwen3_omni) vs transformers 5.24.0's `Qwen3OmniMoeForConditionalGeneration` talker.

Run by `make parity` in .venv-parity-omni (transformers==5.24.0); anywhere else the module skips,
saying why (the project venv has vLLM's transformers pin).

Two parts:
  * the forward checks of tests/models/test_qwen3_omni_parity.py (MoE block and routing, backbone
    prefill + cached decode vs upstream cached and full recompute, code predictor CB1..15, the
    greedy loop vs upstream `generate`, default and batch-invariant paths, float64) are run here
    too, imported from that file, their max differences entered in the parity table;
  * here, float32: a tiny random upstream talker written as a checkpoint, loaded by our
    `load_checkpoint`; upstream's prompt helpers and `talker.generate` (greedy, its CB0
    suppression, repetition penalty 1.0 and, separately, its default 1.05) against our
    `LockstepEngine` for FRAMES frames, codes compared frame by frame and the engine's CB0
    logits against generate's; and the reverse: `save_checkpoint` of ours opened by the official
    `Qwen3OmniMoeForConditionalGeneration.from_pretrained` (a tiny thinker / code2wav in the
    config: the checkpoint holds only the talker and the thinker's embedding table), which must
    load every talker.* tensor bit-identical and report none missing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest
import torch

from safetensors.torch import save_file

from parity_support import close, leading_same, record_greedy, record_load, record_tensor

TALKER = "Qwen3-Omni"
TRANSFORMERS = "5.24.0"
transformers = pytest.importorskip("transformers")
if transformers.__version__ != TRANSFORMERS:
    pytest.skip(f"Qwen3-Omni parity pins transformers=={TRANSFORMERS} (.venv-parity-omni); this venv has "
                f"{transformers.__version__}", allow_module_level=True)

from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as upstream_config  # noqa: E402
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as upstream_modeling  # noqa: E402

from models.qwen3_omni import STAND_IN, OmniInputs, load_checkpoint, save_checkpoint  # noqa: E402
from models.qwen3_omni.checkpoint import THINKER_EMBED  # noqa: E402
from mtp_fsm.engine import LockstepEngine, NewRequest  # noqa: E402
from mtp_fsm.sampling import GREEDY  # noqa: E402

# The float64 forward checks, from the optional module of the main suite (same tiny model).
_SHARED = Path(__file__).resolve().parents[1] / "models" / "test_qwen3_omni_parity.py"
_spec = importlib.util.spec_from_file_location("_qwen3_omni_forward_checks", _SHARED)
shared = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = shared
_spec.loader.exec_module(shared)

pairs = shared.pairs
test_upstream_checkpoint_loads_to_the_same_weights = shared.test_upstream_checkpoint_loads_to_the_same_weights
test_projections_match_upstream = shared.test_projections_match_upstream
test_moe_block_matches_upstream = shared.test_moe_block_matches_upstream
test_backbone_prefill_and_cached_decode_match_upstream = shared.test_backbone_prefill_and_cached_decode_match_upstream
test_code_predictor_greedy_matches_upstream = shared.test_code_predictor_greedy_matches_upstream
test_greedy_frames_match_upstream_generate = shared.test_greedy_frames_match_upstream_generate

FRAMES = 30
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _forward_checks_into_the_table():
    """The shared module keeps max |diff| per check in its DIFFS (tolerance 1e-5 x max(1, max
    |reference|)); they go into the parity table at the end of this module."""
    yield
    for what, diff in shared.DIFFS.items():
        record_tensor(TALKER, f"float64 {what}", diff, diff, TOL, note="scaled by max(1, max |ref|)")


# ---------------------------------------------------------------- float32: engine and reverse load


class Float32Pair(shared.Pair):
    def __init__(self, directory):
        previous, shared.DTYPE = shared.DTYPE, torch.float32
        try:
            super().__init__(directory, norm_topk_prob=True, batch_invariant=False, seed=3)
            self.directory = directory
        finally:
            shared.DTYPE = previous


@pytest.fixture(scope="module")
def pair32(tmp_path_factory):
    return Float32Pair(tmp_path_factory.mktemp("omni32"))


def request_rows(pair):
    """A user turn with three multimodal positions, then the assistant's text (as the shared greedy
    test builds it): the thinker's rows, for upstream's helpers and for OmniInputs."""
    cfg = pair.ours.config
    gen = torch.Generator().manual_seed(41)
    audio = STAND_IN.encode("a")[0]
    user_ids = ([cfg.im_start_token_id, cfg.user_token_id, STAND_IN.newline_id, audio, audio, audio]
                + STAND_IN.encode("hi") + [cfg.im_end_token_id, STAND_IN.newline_id])
    mm = torch.tensor([False] * 3 + [True] * 3 + [False] * 4)
    assistant_ids = [cfg.im_start_token_id, cfg.assistant_token_id, STAND_IN.newline_id] + STAND_IN.encode("hello")
    ids = torch.tensor(user_ids + assistant_ids)
    thinker_hidden = torch.randn(1, ids.numel(), cfg.thinker_hidden_size, generator=gen, dtype=torch.float32)
    return ids, len(user_ids), mm, thinker_hidden


@torch.no_grad()
def upstream_greedy(pair, frames: int, penalty: float):
    cfg, upstream = pair.ours.config, pair.upstream
    ids, n_user, mm, thinker_hidden = request_rows(pair)
    thinker_embed = pair.table[ids][None]
    speaker = cfg.speaker_id["chelsie"]
    owner = SimpleNamespace(talker=upstream, config=SimpleNamespace(talker_config=upstream.config,
                                                                    tts_pad_token_id=cfg.tts_pad_token_id))
    tts_bos, tts_eos, tts_pad = (r[None, None] for r in pair.upstream_specials())
    full = upstream_modeling.Qwen3OmniMoeForConditionalGeneration
    user_part = full._get_talker_user_parts(owner, 0, n_user, mm[None], thinker_hidden, thinker_embed)
    assistant_part, _, trailing = full._get_talker_assistant_parts(
        owner, n_user, ids.numel(), speaker, thinker_embed, tts_pad, tts_bos, tts_eos)
    prompt = torch.cat([user_part, assistant_part], dim=1)
    suppress = [i for i in range(cfg.vocab_size - 1024, cfg.vocab_size) if i != cfg.codec_eos_token_id]
    length = prompt.shape[1]
    upstream.rope_deltas = None
    result = upstream.generate(
        inputs_embeds=prompt, trailing_text_hidden=trailing, tts_pad_embed=tts_pad,
        # generate's repetition penalty reads these ids too: the codec pad id, a suppressed id that
        # no CB0 choice can be, so only the generated CB0 ids are penalised (as in ours).
        talker_input_ids=torch.full((1, length), cfg.codec_pad_id),
        attention_mask=torch.ones(1, length, dtype=torch.long),
        max_new_tokens=frames + 1, do_sample=False, repetition_penalty=penalty, eos_token_id=cfg.codec_eos_token_id,
        suppress_tokens=suppress, output_hidden_states=True, output_logits=True, return_dict_in_generate=True)
    cb0 = result.sequences[0, -len(result.logits):]
    assert cfg.codec_eos_token_id not in cb0.tolist(), "the random model stopped early: pick another seed"
    # A frame's CB1..15 appear in the hidden_states of the step that feeds it back.
    codes = torch.stack([h[-1][0] for h in result.hidden_states if h[-1] is not None])[:frames]
    assert codes.shape[0] == frames and torch.equal(codes[:, 0], cb0[:frames])
    inputs = OmniInputs(prompt_rows=pair.table[ids[: n_user + 4]], user_hidden=thinker_hidden[0, :n_user],
                        user_mm_mask=mm, speaker_id=speaker, feed_rows=pair.table[ids[n_user + 4:]], feed_done=True)
    return codes, torch.stack(result.logits)[:frames, 0], inputs


def engine_run(model, inputs, frames: int, penalty: float):
    """Our LockstepEngine, greedy CB0 and code predictor; CB0 logits captured per step."""
    seen: list[torch.Tensor] = []
    original = model.cb0_logits

    def capture(hidden):
        logits = original(hidden)
        seen.append(logits[0].detach().clone())
        return logits

    model.cb0_logits = capture
    engine = LockstepEngine(model, 1)
    try:
        cb0 = attrs.evolve(GREEDY, repetition_penalty=penalty)
        out = engine.generate([NewRequest("r", inputs, max_frames=frames, cb0_sampling=cb0, mtp_sampling=GREEDY)])
    finally:
        engine.close()
        del model.cb0_logits
    return torch.stack([f.codes for f in out["r"].frames]), torch.stack(seen)


@pytest.mark.parametrize("penalty", [1.0, 1.05], ids=["penalty1.0", "penalty1.05-upstream-default"])
def test_engine_greedy_codes_match_upstream_generate(pair32, penalty):
    ref_codes, ref_logits, inputs = upstream_greedy(pair32, FRAMES, penalty)
    model = load_checkpoint(pair32.directory, dtype=torch.float32)
    codes, logits = engine_run(model, inputs, FRAMES, penalty)
    same = leading_same(codes, ref_codes)
    record_greedy(TALKER, f"LockstepEngine vs upstream generate, greedy, repetition penalty {penalty}", same,
                  max(len(codes), len(ref_codes)))
    print(f"PARITY {TALKER} engine greedy (penalty {penalty}): {same} of {len(ref_codes)} frames identical")
    assert codes.shape == ref_codes.shape and same == FRAMES, f"first divergence at frame {same}"
    # The logits the engine sampled CB0 from, step by step, vs generate's (before its processors).
    close(TALKER, logits[:FRAMES], ref_logits, f"engine CB0 logits, {FRAMES} steps (penalty {penalty})", TOL)


def test_official_from_pretrained_opens_our_checkpoint(pair32, tmp_path):
    """save_checkpoint of ours -> the official full model's from_pretrained: every talker.* tensor
    loaded (none missing, none unexpected) and equal to ours; thinker / code2wav (not held by a
    talker checkpoint) made tiny in the config so the model is small, and reported missing."""
    model = load_checkpoint(pair32.directory, dtype=torch.float32)
    directory = save_checkpoint(model, tmp_path / "ours", thinker_embed_tokens=pair32.table)
    config = upstream_config.Qwen3OmniMoeConfig.from_pretrained(str(directory))
    cfg = model.config
    text = config.thinker_config.text_config
    for key, value in dict(hidden_size=cfg.thinker_hidden_size, vocab_size=cfg.thinker_vocab_size,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           intermediate_size=32, moe_intermediate_size=16, num_experts=2,
                           num_experts_per_tok=1).items():
        setattr(text, key, value)
    for sub in (config.thinker_config.audio_config, config.thinker_config.vision_config):
        for key, value in dict(num_hidden_layers=1, encoder_layers=1, depth=1, hidden_size=32, d_model=32,
                               num_heads=2, encoder_attention_heads=2, intermediate_size=32,
                               encoder_ffn_dim=32, output_dim=cfg.thinker_hidden_size,
                               out_hidden_size=cfg.thinker_hidden_size).items():
            if hasattr(sub, key):
                setattr(sub, key, value)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its load report lists every thinker / code2wav tensor as missing
    try:
        official, info = upstream_modeling.Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            str(directory), config=config, dtype=torch.float32, output_loading_info=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
    official_talker = {k: v for k, v in official.state_dict().items() if k.startswith("talker.")}
    missing_talker = sorted(k for k in info["missing_keys"] if k.startswith("talker."))
    unexpected = sorted(info["unexpected_keys"])
    mismatched = sorted(str(k) for k in info.get("mismatched_keys", []))
    # Ours saves the experts one by one (the released layout), the official class holds them fused:
    # what it loaded, written back as a checkpoint, must give our loader our weights bit for bit.
    back_dir = tmp_path / "official"
    back_dir.mkdir()
    save_file({**{k: v.contiguous() for k, v in official_talker.items()}, THINKER_EMBED: pair32.table},
              str(back_dir / "model.safetensors"))
    (back_dir / "config.json").write_text((directory / "config.json").read_text())
    back = load_checkpoint(back_dir, dtype=torch.float32).module.state_dict()
    differing = [k for k, v in model.module.state_dict().items() if not torch.equal(back[k], v)]
    ok = not (missing_talker or unexpected or mismatched or differing)
    record_load(TALKER, f"our checkpoint -> official Qwen3OmniMoeForConditionalGeneration.from_pretrained: "
                        f"{len(official_talker)} talker tensors, bit-identical", ok,
                note=f"missing talker {missing_talker[:3]}, unexpected {unexpected[:3]}, differing {differing[:3]}")
    print(f"PARITY {TALKER} reverse load: {len(official_talker)} talker tensors, missing {len(missing_talker)}, "
          f"unexpected {len(unexpected)}, differing {len(differing)}; thinker/code2wav missing (not a talker's): "
          f"{len(info['missing_keys']) - len(missing_talker)}")
    assert not missing_talker, f"official talker tensors missing from our checkpoint: {missing_talker[:5]}"
    assert not unexpected, f"tensors the official class does not know: {unexpected[:5]}"
    assert not mismatched, mismatched[:5]
    assert not differing, f"loaded tensors differ from the saved ones: {differing[:5]}"
