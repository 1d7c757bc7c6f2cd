"""Chatterbox Turbo T3 (models/chatterbox) vs chatterbox-tts 0.1.7's `T3`, numerically.

Run by `make parity` in .venv-parity-chatterbox: chatterbox-tts installed --no-deps (its pins are the
whole TTS app: torch 2.6, gradio, ...) plus what its T3 subpackage imports (transformers 5.2.0,
einops, tqdm). The package's `__init__` imports the app (tts, vc, the S3 tokenizer, S3Gen, the
watermarker); it is registered here as an empty package over the installed folder so only
`chatterbox.models.t3` and `chatterbox.models.utils` run, unmodified. Without chatterbox the module
skips, saying why.

The model: upstream's `T3` built as `ChatterboxTurboTTS.from_local` builds it (GPT-2 backbone, no
perceiver / emotion / learned text-speech positions, `input_pos_emb=None`), with the tiny sizes of
our `tiny_config()` registered as an extra `LLAMA_CONFIGS` entry (upstream's T3 reads its backbone
sizes from that table only). Ours: a tiny talker whose weights are redrawn (norms 1 + 0.1 N,
biases 0.1 N, embeddings N, matrices N / sqrt(fan_in): O(1) logits, far from greedy ties), saved
with `save_checkpoint(upstream_strict=True)`, loaded strictly by upstream's `load_state_dict` and
by our `load_checkpoint`.

Greedy: upstream `inference_turbo(temperature=0, top_k=1, top_p=1.0)` (top-k 1 leaves one
candidate, so its multinomial is the argmax) vs our LockstepEngine with temperature 0, top-k 1,
FRAMES frames, the CB0 logits of every step compared too; twice: repetition penalty 1.0 on both
sides, and each side's default (upstream's 1.2 after its filters, ours the model's: the same since
issue 31's mismatch 2 was fixed, so top-k 1 stays greedy on both sides). Start-of-
speech is masked (-inf) in our head on purpose (upstream T3 may sample it, which makes no speech
token); for a seed where upstream's argmax is start-of-speech the test asserts exactly that: frames
identical up to it, ours at that frame is upstream's argmax over the other ids, and records the run
as a documented divergence rather than an identical one.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import attrs
import pytest
import torch
from safetensors.torch import load_file

from parity_support import close, leading_same, record_greedy, record_load

TALKER = "Chatterbox T3"
CHATTERBOX = "0.1.7"


def _register_package_skeleton() -> None:
    """`chatterbox` as an empty package over the installed folder (its __init__ imports the app)."""
    if "chatterbox" in sys.modules:
        return
    spec = importlib.util.find_spec("chatterbox")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("chatterbox-tts is not installed: .venv-parity-chatterbox (make parity) has it "
                    f"(this venv: {sys.prefix})", allow_module_level=True)
    root = list(spec.submodule_search_locations)[0]
    module = types.ModuleType("chatterbox", "chatterbox (package body skipped: it imports the TTS app)")
    module.__path__ = [root]
    module.__file__ = f"{root}/__init__.py"
    module.__spec__ = importlib.util.spec_from_file_location("chatterbox", module.__file__,
                                                             submodule_search_locations=[root])
    sys.modules["chatterbox"] = module


_register_package_skeleton()
from importlib.metadata import version  # noqa: E402

if version("chatterbox-tts") != CHATTERBOX:
    pytest.skip(f"chatterbox parity pins chatterbox-tts=={CHATTERBOX}, found {version('chatterbox-tts')}",
                allow_module_level=True)
upstream_t3 = pytest.importorskip("chatterbox.models.t3.t3")
upstream_cond = pytest.importorskip("chatterbox.models.t3.modules.cond_enc")
upstream_hp = pytest.importorskip("chatterbox.models.t3.modules.t3_config")
upstream_llama = pytest.importorskip("chatterbox.models.t3.llama_configs")

from models.chatterbox import ChatterboxInputs, ChatterboxTalker, load_checkpoint, save_checkpoint, tiny_config  # noqa: E402
from mtp_fsm.engine import LockstepEngine, NewRequest  # noqa: E402
from mtp_fsm.sampling import GREEDY  # noqa: E402

FRAMES = 24
TOL = 1e-5
UPSTREAM_DEFAULT_PENALTY = 1.2  # T3.inference_turbo's and ChatterboxTurboTTS.generate's default
TINY = "mtp_fsm_tiny_gpt2"


def upstream_model(cfg) -> torch.nn.Module:
    """upstream T3 as ChatterboxTurboTTS.from_local builds it, at our config's sizes."""
    upstream_llama.LLAMA_CONFIGS[TINY] = dict(
        upstream_llama.LLAMA_CONFIGS["GPT2_medium"], n_embd=cfg.hidden_size, hidden_size=cfg.hidden_size,
        n_layer=cfg.num_hidden_layers, n_head=cfg.num_attention_heads, n_inner=cfg.intermediate_size,
        n_positions=cfg.n_positions, n_ctx=cfg.n_positions, layer_norm_epsilon=cfg.layer_norm_epsilon,
        activation_function=cfg.activation_function, vocab_size=cfg.gpt_vocab_size)
    hp = upstream_hp.T3Config(text_tokens_dict_size=cfg.text_tokens_dict_size)
    hp.llama_config_name = TINY
    hp.speech_tokens_dict_size = cfg.speech_tokens_dict_size
    hp.start_speech_token, hp.stop_speech_token = cfg.start_speech_token, cfg.stop_speech_token
    hp.input_pos_emb = None
    hp.speech_cond_prompt_len = cfg.speech_cond_prompt_len
    hp.use_perceiver_resampler = False
    hp.emotion_adv = False
    hp.speaker_embed_size = cfg.speaker_embed_size
    return upstream_t3.T3(hp).eval()


@torch.no_grad()
def redraw(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if ".ln_" in name or name.startswith("tfmr.ln_f"):
            p.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        elif "emb" in name or "wpe" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / p.shape[0 if "tfmr.h." in name and "c_" in name else -1] ** 0.5)


class Pair:
    def __init__(self, directory, seed: int, sos_bias: float):
        cfg = tiny_config(batch_invariant=False)
        ours = ChatterboxTalker(cfg, seed=seed)
        redraw(ours.module, seed)
        with torch.no_grad():  # the stop token far below the codes: runs reach FRAMES frames
            ours.module.speech_head.bias[cfg.stop_speech_token] -= 8.0
            # start-of-speech likewise, except in the run that shows what our mask changes
            ours.module.speech_head.bias[cfg.start_speech_token] += sos_bias
        self.directory = save_checkpoint(ours, directory / "tiny", upstream_strict=True)
        self.config = cfg
        self.upstream = upstream_model(cfg)
        state = load_file(str(self.directory / "model.safetensors"))
        missing, unexpected = self.upstream.load_state_dict(state, strict=True)
        assert not missing and not unexpected
        del self.upstream.tfmr.wte  # as ChatterboxTurboTTS.from_local does after loading
        self.ours = load_checkpoint(self.directory, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed + 100)
        self.inputs = ChatterboxInputs(
            text="Parity, please.",
            speaker_emb=tuple(torch.randn(cfg.speaker_embed_size, generator=gen).tolist()),
            cond_tokens=tuple(torch.randint(0, cfg.codebook_size, (cfg.speech_cond_prompt_len,), generator=gen).tolist()))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    made: dict[tuple[int, float], Pair] = {}

    def get(seed: int, sos_bias: float = -8.0) -> Pair:
        if (seed, sos_bias) not in made:
            made[seed, sos_bias] = Pair(tmp_path_factory.mktemp(f"chatterbox{seed}"), seed, sos_bias)
        return made[seed, sos_bias]

    return get


@torch.no_grad()
def upstream_greedy(pair: Pair, frames: int, penalty: float):
    """inference_turbo greedy (top-k 1), and the speech_head logits of every step."""
    cfg, model = pair.config, pair.upstream
    text = torch.tensor([list(pair.inputs.text.encode())])
    cond = upstream_cond.T3Cond(speaker_emb=torch.tensor(pair.inputs.speaker_emb)[None],
                                cond_prompt_speech_tokens=torch.tensor(pair.inputs.cond_tokens)[None],
                                emotion_adv=None)
    seen: list[torch.Tensor] = []
    handle = model.speech_head.register_forward_hook(lambda m, i, out: seen.append(out[0, -1].clone()))
    try:
        penalty_kw = {} if penalty is None else {"repetition_penalty": penalty}  # None: upstream's default
        codes = model.inference_turbo(cond, text, temperature=0.0, top_k=1, top_p=1.0, max_gen_len=frames - 1,
                                      **penalty_kw)
    finally:
        handle.remove()
    assert cfg.stop_speech_token not in codes[0].tolist()
    return codes[0], torch.stack(seen)


def engine_greedy(pair: Pair, frames: int, penalty: float):
    model = pair.ours
    seen: list[torch.Tensor] = []
    original = model.cb0_logits

    def capture(hidden):
        logits = original(hidden)
        seen.append(logits[0].detach().clone())
        return logits

    model.cb0_logits = capture
    engine = LockstepEngine(model, 1)
    try:
        # Upstream's greedy is top-k 1 (inference_turbo applies the penalty after its filters, on the
        # one score top-k kept); ours the same parameters, temperature 0; penalty None: the model's
        # default (upstream's 1.2, ModelSpec.repetition_penalty).
        out = engine.generate([NewRequest("r", pair.inputs, max_frames=frames,
                                          cb0_sampling=attrs.evolve(GREEDY, top_k=1, repetition_penalty=penalty))])
    finally:
        engine.close()
        del model.cb0_logits
    return torch.stack([f.codes[0] for f in out["r"].frames]), torch.stack(seen)


def test_upstream_t3_loads_our_checkpoint_strictly(pairs):
    pair = pairs(11)
    ours = pair.ours.module.state_dict()
    theirs = pair.upstream.state_dict()
    held = sorted(k for k in theirs if k in ours)
    assert sorted(ours) == held, sorted(set(ours) ^ set(held))
    worst = max((theirs[k] - ours[k]).abs().max().item() for k in held)
    extra = sorted(set(theirs) - set(ours))
    record_load(TALKER, f"our checkpoint (upstream_strict) -> upstream T3.load_state_dict(strict=True): "
                        f"{len(held)} tensors bit-identical", worst == 0.0, note=f"not held by ours: {extra}")
    print(f"PARITY {TALKER} strict load: {len(held)} tensors, max |diff| {worst}; upstream-only: {extra}")
    assert worst == 0.0
    assert extra == ["text_head.weight"], extra  # the training-only text loss head (tfmr.wte deleted)


def test_model_default_penalty_is_upstreams():
    """Issue 31 mismatch 2: inference_turbo's default repetition penalty (1.2), applied after its
    temperature / top-k / top-p processors."""
    import inspect

    spec = ChatterboxTalker(tiny_config(), seed=0).spec
    default = inspect.signature(upstream_t3.T3.inference_turbo).parameters["repetition_penalty"].default
    assert default == UPSTREAM_DEFAULT_PENALTY
    assert spec.repetition_penalty == default and spec.repetition_penalty_order == "after_filters"


@pytest.mark.parametrize("penalty", [1.0, None], ids=["penalty1.0", "default-penalty"])
@pytest.mark.parametrize("seed,sos_bias", [(11, -8.0), (12, -8.0), (13, -8.0), (12, 0.0)],
                         ids=["seed11", "seed12", "seed13", "seed12-start-of-speech-unbiased"])
def test_engine_greedy_matches_upstream_inference_turbo(pairs, seed, sos_bias, penalty):
    """Seeds 11-13 with start-of-speech (and stop) biased away: identical for FRAMES frames. Seed 12
    as drawn: upstream's argmax is start-of-speech at frame 17, which our head masks: asserted and
    recorded as a documented divergence (upstream T3 would feed that token back as speech)."""
    pair = pairs(seed, sos_bias)
    cfg = pair.config
    ref, ref_logits = upstream_greedy(pair, FRAMES, penalty)
    codes, logits = engine_greedy(pair, FRAMES, penalty)
    sos = cfg.start_speech_token
    assert torch.isinf(logits[:, sos]).all() and (logits[:, sos] < 0).all(), "start-of-speech is not masked"
    picks = (ref == sos).nonzero()
    tag = (f"seed {seed}{'' if sos_bias else ', start-of-speech unbiased'}, penalty "
           f"{penalty if penalty is not None else f'default ({UPSTREAM_DEFAULT_PENALTY} both sides)'}")
    if len(picks) == 0:
        same = leading_same(codes[:, None], ref[:, None])
        record_greedy(TALKER, f"LockstepEngine vs upstream inference_turbo, greedy ({tag})", same, len(ref))
        print(f"PARITY {TALKER} greedy ({tag}): {same} of {len(ref)} frames identical")
        assert torch.equal(codes, ref), f"first divergence at frame {same}"
        n = len(ref)
    else:
        # Upstream's argmax is start-of-speech at frame k: ours masks it on purpose. Identical
        # before k; at k ours is upstream's best id other than start-of-speech.
        k = int(picks[0])
        same = leading_same(codes[:, None], ref[:, None])
        runner_up = ref_logits[k].clone()
        runner_up[sos] = float("-inf")
        record_greedy(TALKER, f"LockstepEngine vs upstream inference_turbo, greedy ({tag})", same, len(ref),
                      divergence=f"upstream picks start-of-speech ({sos}) at frame {k}, which ours masks; "
                                 f"ours takes upstream's runner-up {int(runner_up.argmax())} there")
        print(f"PARITY {TALKER} greedy ({tag}): upstream picks start-of-speech at frame {k}; {same} frames identical")
        assert same == k, f"frames differ before upstream's start-of-speech pick (first at {same}, pick at {k})"
        assert int(codes[k]) == int(runner_up.argmax())
        n = k + 1
    keep = torch.ones(cfg.speech_tokens_dict_size, dtype=torch.bool)
    keep[sos] = False
    close(TALKER, logits[:n][:, keep], ref_logits[:n][:, keep],
          f"speech_head logits (start-of-speech column aside), {n} steps ({tag})", TOL)
