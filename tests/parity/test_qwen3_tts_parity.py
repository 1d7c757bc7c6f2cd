"""Qwen3-TTS (models/qwen3_tts) vs the official implementation, PyPI qwen-tts==0.1.1, numerically.

Run with `make parity` (its own virtualenv, .venv-parity: qwen-tts pins transformers==4.57.3);
`-s` prints one PARITY line per comparison and the run ends with the table of max differences
(conftest.py). Under `make test` (no qwen_tts) the module is skipped at import.

The reference is `qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSForConditionalGeneration`: its
`generate` builds the prompt of every layout (instruct, speaker / language / dialect, streaming and
non-streaming text, x-vector and ICL voice clone), left-pads a batch, and calls the talker's HF
`generate` with repetition_penalty=1.05, min_new_tokens=2 and suppress_tokens (every id in the
top 1024 of the codec vocab but EOS); the code predictor is an HF `generate` of 15 tokens per
frame. Both sides run greedy (official do_sample=False, subtalker_dosample=False; ours
mtp_fsm.sampling.GREEDY for CB0 and MTP, repetition penalty and min length left to the model's
defaults).

The model: the official config classes at tiny sizes taken from our `tiny_config()` (talker hidden
64, 2 layers, 4 heads / 2 KV heads, head_dim 16; code predictor hidden 32, 2 layers, 4 / 2 heads,
head_dim 8, 16 groups x 2048 codes; codec vocab 3072 with the released special ids), a 1024-entry
text vocab whose chat-template ids are our config's, two preset speakers (one a dialect speaker)
and three language tags. Every parameter is drawn anew (norm weights 1 + 0.1 N, biases 0.1 N,
embeddings N, matrices N / sqrt(fan_in)) so logits are O(1) and greedy choices are far from ties,
then `wire()` makes six CB0 ids lead every step, so greedy CB0 repeats like a trained talker's and
the repetition penalty decides codes (a control test proves it does). float32 throughout; the
official attention is its default (SDPA).

Checks (tolerance: |ours - official| <= 1e-5 * max(1, |official|) elementwise; codes exactly):
  * forward: official `save_pretrained` -> our `load_checkpoint`; per layout, the prompt and
    trailing-text embeddings, then the CB0 logits of every step and the code-predictor logits of
    every codebook of every frame, ours teacher-forced on the official codes (single slot, the
    adapter's prepare / forward / cb0_logits / mtp / frame_embed / text_step hooks);
  * greedy codes of 48 frames through our LockstepEngine, 1 request and 2 requests of different
    lengths (one official left-padded batch vs our engine running both at once), every layout;
  * the batch-invariant path (`batch_invariant=True` in the checkpoint's mtp_fsm block) and the
    default one for GQA shapes (query / KV heads, talker and code predictor alike) 4/2, 8/2 and
    16/8 (two layouts, two requests);
  * the greedy checks can fail: with the penalty off our codes diverge; an EOS-leaning model
    stops after exactly min_new_tokens=2 frames on both sides, and at 0 with min_frames=0;
  * reverse: our `save_checkpoint` -> official `Qwen3TTSForConditionalGeneration.from_pretrained`
    -> the same weights and logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from parity_support import leading_same, record, record_greedy, record_load  # registers the official package skeleton (see there)

pytest.importorskip("qwen_tts")
official_config = pytest.importorskip("qwen_tts.core.models.configuration_qwen3_tts")
official_modeling = pytest.importorskip("qwen_tts.core.models.modeling_qwen3_tts")

from models.qwen3_tts import Qwen3TTSTalker, TTSInputs, load_checkpoint, save_checkpoint, tiny_config  # noqa: E402
from models.qwen3_tts.config import _mrope_section  # noqa: E402
from mtp_fsm.engine import LockstepEngine, NewRequest  # noqa: E402
from mtp_fsm.sampling import GREEDY, SamplingParams  # noqa: E402

DTYPE = torch.float32
TOL = 1e-5
FRAMES = 48
OFFICIAL_REPETITION_PENALTY = 1.05  # Qwen3TTSForConditionalGeneration.generate's default
OFFICIAL_MIN_NEW_TOKENS = 2  # hard-coded in its talker_kwargs

TEXT_VOCAB = 1024
# Chat-template ids (top-level config.json fields) inside the tiny text vocab. "\n" and "user" are
# not config fields: the official side gets whatever our loaded config uses (read from it below).
TEXT_IDS = dict(im_start_token_id=900, im_end_token_id=901, assistant_token_id=902,
                tts_pad_token_id=903, tts_bos_token_id=904, tts_eos_token_id=905)
SPK_ID = {"vivian": 3000, "dylan": 3001}
SPK_IS_DIALECT = {"vivian": False, "dylan": "beijing_dialect"}
LANGUAGE_ID = {"chinese": 2050, "english": 2051, "beijing_dialect": 2052}


# ---------------------------------------------------------------- comparisons


def close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    """Elementwise |ours - ref| <= TOL * max(1, |ref|): relative for large entries (a hot CB0 logit
    of 30 carries float32 rounding of ~1e-5), absolute for small ones."""
    ours, ref = ours.detach().double(), ref.detach().double()
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs official {tuple(ref.shape)}"
    if not ref.numel():
        return 0.0
    diff = (ours - ref).abs()
    scaled = (diff / ref.abs().clamp(min=1.0)).max().item()
    worst = diff.max().item()
    record(what, worst, scaled, TOL)
    print(f"PARITY {what}: max abs diff {worst:.3e}, scaled {scaled:.3e} (official max |x| {ref.abs().max().item():.3g})")
    assert scaled <= TOL, f"{what}: |diff| / max(1, |official|) reaches {scaled:.3e} > {TOL:g} (max abs diff {worst:.3e})"
    return worst


def first_divergence(ours: torch.Tensor, ref: torch.Tensor) -> str:
    n = min(len(ours), len(ref))
    rows = (ours[:n] != ref[:n]).any(-1).nonzero()
    if len(rows) == 0:
        return f"same codes for {n} frames, then {len(ours)} frames ours vs {len(ref)} official"
    f = int(rows[0])
    g = int((ours[f] != ref[f]).nonzero()[0])
    return (f"first divergence at frame {f}, codebook {g}: ours {ours[f, g].item()} vs official "
            f"{ref[f, g].item()} ({len(ours)} frames ours, {len(ref)} official)")


def cb0_margin(captured: dict, row: int, codes: torch.Tensor) -> float:
    """The smallest gap between the official's best and second-best CB0 candidate over the run,
    after its logits processors (penalty on published ids, min length, suppressed ids): how far
    from a tie the greedy choices are (the logits agree to ~1e-5)."""
    eos, codebook = tiny_config().codec_eos_token_id, tiny_config().codebook_size
    gap = float("inf")
    for k, step in enumerate(captured["logits"][: len(codes) + 1]):
        x = step[row].double().clone()
        seen = codes[:k, 0].unique()
        x[seen] = torch.where(x[seen] > 0, x[seen] / OFFICIAL_REPETITION_PENALTY, x[seen] * OFFICIAL_REPETITION_PENALTY)
        keep = x[eos].clone()
        x[codebook:] = float("-inf")
        x[eos] = float("-inf") if k < OFFICIAL_MIN_NEW_TOKENS else keep
        top = x.topk(2).values
        gap = min(gap, (top[0] - top[1]).item())
    return gap


def same_codes(ours: torch.Tensor, ref: torch.Tensor, what: str, margin: float | None = None) -> None:
    n = min(len(ours), len(ref))
    mismatched = int((ours[:n] != ref[:n]).any(-1).sum()) + abs(len(ours) - len(ref))
    record(what, float(mismatched), None, None)
    record_greedy("Qwen3-TTS", what, leading_same(ours, ref) if mismatched else len(ours), max(len(ours), len(ref)))
    print(f"PARITY {what}: {mismatched} of {max(len(ours), len(ref))} frames differ"
          + ("" if margin is None else f" (official CB0 top-2 margin >= {margin:.3g})")
          + ("" if not mismatched else f"; {first_divergence(ours, ref)}"))
    assert len(ours) == len(ref) and torch.equal(ours, ref), f"{what}: {first_divergence(ours, ref)}"


# ---------------------------------------------------------------- the official model and checkpoints


def official_tiny_config(heads: int = 4, kv_heads: int = 2):
    base = tiny_config()
    cp = base.code_predictor
    predictor = dict(
        vocab_size=cp.vocab_size, hidden_size=cp.hidden_size, intermediate_size=cp.intermediate_size,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,  # tiny_config's: 4 / 2
        head_dim=cp.head_dim, rms_norm_eps=cp.rms_norm_eps, rope_theta=cp.rope_theta,
        num_code_groups=base.num_code_groups,
    )
    talker = dict(
        code_predictor_config=predictor, vocab_size=base.vocab_size, hidden_size=base.hidden_size,
        intermediate_size=base.intermediate_size, num_hidden_layers=base.num_hidden_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=base.head_dim,
        rms_norm_eps=base.rms_norm_eps, rope_theta=base.rope_theta,
        rope_scaling={"rope_type": "default", "mrope_section": _mrope_section(base.head_dim), "interleaved": True},
        num_code_groups=base.num_code_groups, text_hidden_size=base.text_hidden_size, text_vocab_size=TEXT_VOCAB,
        codec_eos_token_id=base.codec_eos_token_id, codec_think_id=base.codec_think_id,
        codec_nothink_id=base.codec_nothink_id, codec_think_bos_id=base.codec_think_bos_id,
        codec_think_eos_id=base.codec_think_eos_id, codec_pad_id=base.codec_pad_id, codec_bos_id=base.codec_bos_id,
        spk_id=dict(SPK_ID), spk_is_dialect=dict(SPK_IS_DIALECT), codec_language_id=dict(LANGUAGE_ID),
    )
    return official_config.Qwen3TTSConfig(
        talker_config=talker, tts_model_type="custom_voice", tts_model_size="1b7",
        tokenizer_type="qwen3_tts_tokenizer_12hz", **TEXT_IDS,
    )


@torch.no_grad()
def redraw(named_parameters, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in named_parameters:
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        elif "embedding" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)


# CB0 ids the "repetitive" wiring favours (offsets on their codec_head rows; see wire()).
HOT = {100 + 37 * i: 3.0 + 0.3 * i for i in range(6)}
HOT_CHANNEL, HOT_LEVEL = 0, 20.0


@torch.no_grad()
def wire(model, hot: dict[int, float]) -> None:
    """Make greedy CB0 repeat itself like a trained talker does, so that the repetition penalty
    and the min length decide codes (with plain random weights 2048 near-Gaussian logits almost
    never repeat a token, and the penalty never changes a choice).

    Residual channel 0 carries a constant: every text projection writes HOT_LEVEL there (fc2 row 0
    zero, bias HOT_LEVEL); no codec embedding and no layer output writes it. codec_head reads that
    channel only for the `hot` ids (weight = their offset), which thus lead every step by several
    logits and are chosen over and over; the penalty (logit / 1.05 once an id was published)
    then decides which of them wins. With EOS among them, EOS wins at once and min length decides.
    Official parameter names; applied before save_pretrained, so our loader sees the same weights.
    """
    t, d = model.talker, HOT_CHANNEL
    t.text_projection.linear_fc2.weight[d] = 0
    t.text_projection.linear_fc2.bias[d] = HOT_LEVEL
    t.model.codec_embedding.weight[:, d] = 0
    for embedding in t.code_predictor.model.codec_embedding:
        embedding.weight[:, d] = 0
    for layer in t.model.layers:
        layer.self_attn.o_proj.weight[d] = 0
        layer.mlp.down_proj.weight[d] = 0
    t.codec_head.weight[:, d] = 0
    for token, offset in hot.items():
        t.codec_head.weight[token, d] = offset


def make_official(config, seed: int = 0, hot: dict[int, float] | None = None):
    model = official_modeling.Qwen3TTSForConditionalGeneration(config)
    redraw(model.named_parameters(), seed)
    if hot:
        wire(model, hot)
    return model.to(DTYPE).eval()


class Checkpoint:
    """An official tiny model and the directory its `save_pretrained` wrote."""

    def __init__(self, directory: Path, heads: int = 4, kv_heads: int = 2, seed: int = 0,
                 hot: dict[int, float] | None = HOT):
        self.official = make_official(official_tiny_config(heads, kv_heads), seed, hot)
        self.directory = directory
        self.official.save_pretrained(str(directory))
        self.cache: dict[Any, Any] = {}

    def load_ours(self, batch_invariant: bool = False) -> Qwen3TTSTalker:
        """Our loader on the official directory; batch_invariant via a copy whose config.json
        gains our engine block (`mtp_fsm`), the one way a checkpoint selects that path."""
        directory = self.directory
        if batch_invariant:
            directory = self.directory.with_name(self.directory.name + "-bi")
            if not directory.exists():
                shutil.copytree(self.directory, directory)
                data = json.loads((directory / "config.json").read_text())
                data.setdefault("mtp_fsm", {})["batch_invariant"] = True
                (directory / "config.json").write_text(json.dumps(data, indent=2))
        model = load_checkpoint(directory, dtype=DTYPE)
        assert model.config.batch_invariant == batch_invariant
        return model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: threads only contend (10x slower on a loaded 2-core machine); quiet HF."""
    from transformers.utils import logging as hf_logging

    before, verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    torch.set_num_threads(1)
    # HF generate's notes on greedy calls (temperature ignored, pad id = EOS) are not findings.
    hf_logging.set_verbosity_error()
    yield
    torch.set_num_threads(before)
    hf_logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Checkpoint:
    return Checkpoint(tmp_path_factory.mktemp("official") / "tiny")


# ---------------------------------------------------------------- prompt layouts


@attrs.frozen
class Layout:
    """One request in every form both sides take: our TTSInputs fields and the official
    generate's per-sample arguments (content ids are shared; each side adds its template)."""

    name: str
    text: int  # number of content tokens
    non_streaming: bool = False
    speaker: str | None = None
    language: str | None = None  # None = "auto"
    raw_ids: bool = False  # ours gets speaker_id / language_id instead of the names
    instruct: int = 0  # instruct content tokens
    xvector: bool = False
    ref_frames: int = 0  # ICL reference frames (with xvector)
    ref_text: int = 0


LAYOUTS = [
    Layout("stream", 9),
    Layout("stream+lang", 9, language="english"),
    Layout("stream+spk+lang", 9, speaker="vivian", language="english"),
    Layout("stream+raw-ids", 9, speaker="vivian", language="english", raw_ids=True),
    Layout("stream+dialect(chinese)", 9, speaker="dylan", language="chinese"),
    Layout("stream+dialect(auto)", 9, speaker="dylan"),
    Layout("nonstream+spk+lang", 9, non_streaming=True, speaker="vivian", language="english"),
    Layout("instruct+stream", 9, language="english", instruct=6),
    Layout("instruct+spk+nonstream", 9, non_streaming=True, speaker="vivian", instruct=6),
    Layout("xvector", 9, xvector=True),
    Layout("icl+stream(text>ref)", 12, xvector=True, ref_frames=3, ref_text=4),
    Layout("icl+stream(text<=ref)", 3, xvector=True, ref_frames=12, ref_text=2, language="english"),
    Layout("icl+nonstream", 9, non_streaming=True, xvector=True, ref_frames=5, ref_text=4),
]
LAYOUT_IDS = [layout.name for layout in LAYOUTS]


@attrs.frozen
class Sample:
    """One concrete request: the drawn ids / tensors of a Layout."""

    layout: Layout
    text: list[int]
    instruct: list[int] | None
    ref_text: list[int] | None
    ref_codes: torch.Tensor | None = attrs.field(eq=False)
    xvector: torch.Tensor | None = attrs.field(eq=False)

    @classmethod
    def draw(cls, layout: Layout, seed: int, text_len: int | None = None) -> "Sample":
        gen = torch.Generator().manual_seed(seed)
        base = tiny_config()

        def ids(n: int) -> list[int]:
            return torch.randint(0, 256, (n,), generator=gen).tolist() if n else None  # byte ids: in every text vocab here

        codes = None
        if layout.ref_frames:
            codes = torch.randint(0, base.codebook_size, (layout.ref_frames, base.num_code_groups), generator=gen)
        xvec = torch.randn(base.hidden_size, generator=gen) if layout.xvector else None
        return cls(layout, ids(text_len or layout.text), ids(layout.instruct), ids(layout.ref_text), codes, xvec)

    def ours(self) -> TTSInputs:
        lo = self.layout
        voice: dict[str, Any] = {}
        if lo.raw_ids:
            voice = dict(speaker_id=SPK_ID[lo.speaker], language_id=LANGUAGE_ID.get(lo.language))
        else:
            voice = dict(speaker=lo.speaker, language=lo.language)
        return TTSInputs(text_ids=self.text, non_streaming=lo.non_streaming, instruct_ids=self.instruct,
                         speaker_embedding=self.xvector, ref_text_ids=self.ref_text, ref_codes=self.ref_codes,
                         **voice)


def official_generate(model, cfg, samples: list[Sample], max_new_tokens: int, *, user_token_id: int):
    """The official generate on a batch of samples (all of one layout family), greedy. Returns
    (codes per sample [T, Q], captured: prompt embeds / trailing text / step logits / predictor logits)."""
    nl = cfg.newline_token_id
    im_start, im_end, assistant = cfg.im_start_token_id, cfg.im_end_token_id, cfg.assistant_token_id

    def tensor(ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.long)

    input_ids = [tensor([im_start, assistant, nl] + s.text + [im_end, nl, im_start, assistant, nl]) for s in samples]
    instruct_ids = [None if s.instruct is None else tensor([im_start, user_token_id, nl] + s.instruct + [im_end, nl])
                    for s in samples]
    ref_ids = [None if s.ref_text is None else tensor([im_start, assistant, nl] + s.ref_text + [im_end, nl])
               for s in samples]
    clone = None
    if any(s.xvector is not None for s in samples):
        assert all(s.xvector is not None for s in samples), "a batch is all voice clone or none"
        clone = {"ref_code": [s.ref_codes for s in samples], "ref_spk_embedding": [s.xvector for s in samples],
                 "x_vector_only_mode": [s.ref_codes is None for s in samples],
                 "icl_mode": [s.ref_codes is not None for s in samples]}
    non_streaming = {s.layout.non_streaming for s in samples}
    assert len(non_streaming) == 1, "official non_streaming_mode is per batch"
    captured: dict[str, Any] = {"predictor_logits": []}
    talker = model.talker
    talker_generate, predictor_generate = talker.generate, talker.code_predictor.generate

    def capture_talker(**kwargs):
        captured["inputs_embeds"] = kwargs["inputs_embeds"].clone()
        captured["attention_mask"] = kwargs["attention_mask"].clone()
        captured["trailing_text_hidden"] = kwargs["trailing_text_hidden"].clone()
        captured["tts_pad_embed"] = kwargs["tts_pad_embed"].clone()
        out = talker_generate(**kwargs, output_logits=True)
        captured["logits"] = [x.clone() for x in out.logits]
        return out

    def capture_predictor(**kwargs):
        out = predictor_generate(**kwargs, output_logits=True)
        captured["predictor_logits"].append([x.clone() for x in out.logits])
        return out

    talker.generate, talker.code_predictor.generate = capture_talker, capture_predictor
    try:
        codes, _ = model.generate(
            input_ids=input_ids, instruct_ids=instruct_ids, ref_ids=ref_ids, voice_clone_prompt=clone,
            languages=[s.layout.language or "auto" for s in samples],
            speakers=None if clone is not None else [s.layout.speaker for s in samples],
            non_streaming_mode=non_streaming.pop(), max_new_tokens=max_new_tokens,
            do_sample=False, subtalker_dosample=False,
        )
    finally:
        del talker.generate, talker.code_predictor.generate  # back to the class methods
    return [c.clone() for c in codes], captured


def user_id(model: Qwen3TTSTalker) -> int:
    return model.config.user_token_id


# ---------------------------------------------------------------- our side


class Recorder:
    """An MTP sampler for the hooks: records each codebook's logits, returns the forced codes."""

    def __init__(self):
        self.forced: torch.Tensor | None = None
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, g: int, *args, **kwargs) -> torch.Tensor:
        self.logits.append(logits.clone())
        return self.forced[:, g] if self.forced is not None else logits.argmax(-1)


@torch.no_grad()
def hooks_teacher_forced(model: Qwen3TTSTalker, inputs: TTSInputs, codes: torch.Tensor):
    """Our adapter on one slot, fed the official codes: (prompt, trailing, CB0 logits per step
    [T+1, V], predictor logits per frame [T, Q-1, 2048])."""
    model.bind_slots(1, torch.device("cpu"))
    prepared = model.prepare(inputs)
    spec = model.slot_columns()
    cols = {k: torch.full((2, *c.shape), c.fill, dtype=c.dtype) for k, c in spec.items()}
    trailing = prepared.columns["trailing_text"]
    cols["trailing_text"][0, : trailing.shape[0]] = trailing
    cols["trailing_len"][0] = prepared.columns["trailing_len"]
    slot = torch.zeros(1, dtype=torch.long)
    n = prepared.prompt_embeds.shape[0]
    hidden = model.forward(prepared.prompt_embeds, torch.arange(n), torch.zeros(n, dtype=torch.long))[-1:]
    cb0 = [model.cb0_logits(hidden)[0]]
    predictor = []
    rec = Recorder()
    for f in range(codes.shape[0]):
        rec.forced, rec.logits = codes[f : f + 1], []
        frame = model.mtp(hidden, codes[f : f + 1, 0], rec)
        assert torch.equal(frame, codes[f : f + 1]), "the recording sampler's codes were not used"
        predictor.append(torch.cat(rec.logits))
        step = model.frame_embed(frame) + model.text_step(cols, slot, torch.tensor([f]))
        hidden = model.forward(step, torch.tensor([n + f]), slot)
        cb0.append(model.cb0_logits(hidden)[0])
    return prepared.prompt_embeds, trailing, torch.stack(cb0), torch.stack(predictor) if predictor else None


def engine_codes(model: Qwen3TTSTalker, samples: list[Sample], frames: int = FRAMES, *,
                 cb0: SamplingParams = GREEDY, min_frames: int | None = None) -> list[torch.Tensor]:
    """Our engine running every sample at once (one slot each); the repetition penalty and the
    min length are the model's defaults unless a control overrides them."""
    engine = LockstepEngine(model, len(samples))
    try:
        requests = [NewRequest(f"r{i}", s.ours(), max_frames=frames, cb0_sampling=cb0, mtp_sampling=GREEDY,
                               min_frames=min_frames)
                    for i, s in enumerate(samples)]
        results = engine.generate(requests)
    finally:
        engine.close()
    out = []
    for r in requests:
        gen = results[r.request_id]
        assert gen.finished is not None, f"{r.request_id} did not finish"
        out.append(torch.stack([f.codes for f in gen.frames]) if gen.frames else torch.zeros(0, 16, dtype=torch.long))
    return out


def compare_logits(model: Qwen3TTSTalker, sample: Sample, codes: torch.Tensor, captured: dict, row: int,
                   tag: str) -> None:
    """Prompt, trailing text and every logit of one official batch row vs our hooks."""
    prompt, trailing, cb0, predictor = hooks_teacher_forced(model, sample.ours(), codes)
    mask = captured["attention_mask"][row].bool()
    close(prompt, captured["inputs_embeds"][row][mask], f"{tag} prompt embeds")
    ref_trailing = captured["trailing_text_hidden"][row]
    pad = captured["tts_pad_embed"].reshape(-1)
    close(trailing, ref_trailing[: trailing.shape[0]], f"{tag} trailing text")
    if ref_trailing.shape[0] > trailing.shape[0]:  # the batch pads shorter rows with T(tts_pad)
        close(pad.expand(ref_trailing.shape[0] - trailing.shape[0], -1), ref_trailing[trailing.shape[0]:],
              f"{tag} trailing text padding")
    steps = min(len(captured["logits"]), codes.shape[0] + 1)
    close(cb0[:steps], torch.stack([x[row] for x in captured["logits"][:steps]]), f"{tag} CB0 logits")
    if codes.shape[0]:
        ref = torch.stack([torch.stack([x[row] for x in call]) for call in captured["predictor_logits"][: codes.shape[0]]])
        close(predictor, ref, f"{tag} code-predictor logits")


# ---------------------------------------------------------------- the checks


def test_model_defaults_are_the_official_generate_defaults(ckpt):
    spec = ckpt.load_ours().spec
    assert spec.repetition_penalty == OFFICIAL_REPETITION_PENALTY
    assert spec.min_frames == OFFICIAL_MIN_NEW_TOKENS


def run_official(ckpt: Checkpoint, samples: list[Sample], user: int):
    key = tuple((s.layout.name, len(s.text)) for s in samples)
    if key not in ckpt.cache:
        cfg = ckpt.load_ours().config
        ckpt.cache[key] = official_generate(ckpt.official, cfg, samples, FRAMES + 1, user_token_id=user)
    return ckpt.cache[key]


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_logits_one_request(ckpt, layout):
    model = ckpt.load_ours()
    sample = Sample.draw(layout, seed=1)
    codes, captured = run_official(ckpt, [sample], user_id(model))
    compare_logits(model, sample, codes[0], captured, 0, f"{layout.name} x1")


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_greedy_codes_one_request(ckpt, layout):
    model = ckpt.load_ours()
    sample = Sample.draw(layout, seed=1)
    codes, captured = run_official(ckpt, [sample], user_id(model))
    same_codes(engine_codes(model, [sample])[0], codes[0], f"{layout.name} x1 greedy {FRAMES} frames",
               cb0_margin(captured, 0, codes[0]))


def partner(layout: Layout) -> Layout:
    """The second request of a two-request batch: the same layout family (the official batch
    shares non_streaming_mode and voice clone or not) with a prompt of another length, so the
    official batch left-pads one of them. A streaming prompt holds one text token whatever the
    text length, so there the voice part changes length instead."""
    if layout.instruct:
        return attrs.evolve(layout, instruct=layout.instruct + 5)
    if layout.ref_frames:
        return attrs.evolve(layout, ref_frames=layout.ref_frames + 4)
    if layout.non_streaming:
        return layout  # the whole text is in the prompt: text_len differs
    if layout.speaker == "dylan":  # a dialect speaker's language id is there with chinese or auto
        return attrs.evolve(layout, speaker="vivian", language=None)
    return attrs.evolve(layout, language=None if layout.language else "english")


def two_samples(layout: Layout) -> list[Sample]:
    # Different prompt lengths, text lengths and draws.
    return [Sample.draw(layout, seed=2), Sample.draw(partner(layout), seed=3, text_len=layout.text + 5)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_two_requests(ckpt, layout):
    model = ckpt.load_ours()
    samples = two_samples(layout)
    codes, captured = run_official(ckpt, samples, user_id(model))
    assert captured["attention_mask"].shape[0] == 2 and not captured["attention_mask"].all(), "no left padding"
    for row, sample in enumerate(samples):
        compare_logits(ckpt.load_ours(), sample, codes[row], captured, row, f"{layout.name} x2[{row}]")
    ours = engine_codes(model, samples)
    for row in range(2):
        same_codes(ours[row], codes[row], f"{layout.name} x2[{row}] greedy {FRAMES} frames",
                   cb0_margin(captured, row, codes[row]))


def test_control_greedy_codes_depend_on_the_penalty(ckpt):
    """The greedy checks can fail: with the penalty off, our codes leave the official ones."""
    model = ckpt.load_ours()
    sample = Sample.draw(LAYOUTS[2], seed=1)
    codes, _ = run_official(ckpt, [sample], user_id(model))
    ours = engine_codes(model, [sample], cb0=attrs.evolve(GREEDY, repetition_penalty=1.0))[0]
    print(f"PARITY control, {LAYOUTS[2].name} with repetition_penalty=1.0: {first_divergence(ours, codes[0])}")
    assert not torch.equal(ours, codes[0]), "the repetition penalty changes no greedy choice: the check is blind"


EOS = tiny_config().codec_eos_token_id


@pytest.fixture(scope="module")
def eos_ckpt(tmp_path_factory) -> Checkpoint:
    """EOS leads every step: the official generate stops right after its min_new_tokens=2."""
    return Checkpoint(tmp_path_factory.mktemp("eos") / "tiny", hot={**HOT, EOS: 10.0})


@pytest.mark.parametrize("requests", [1, 2])
def test_min_length_eos_leaning(eos_ckpt, requests):
    model = eos_ckpt.load_ours()
    layout = LAYOUTS[2]
    samples = two_samples(layout)[:requests]
    codes, captured = run_official(eos_ckpt, samples, user_id(model))
    assert [len(c) for c in codes] == [OFFICIAL_MIN_NEW_TOKENS] * requests  # the model is what it should be
    for row, sample in enumerate(samples):
        compare_logits(eos_ckpt.load_ours(), sample, codes[row], captured, row, f"eos-leaning x{requests}[{row}]")
    ours = engine_codes(model, samples)
    for row in range(requests):
        same_codes(ours[row], codes[row], f"eos-leaning x{requests}[{row}] greedy (min length)")
    control = engine_codes(eos_ckpt.load_ours(), samples, min_frames=0)
    print(f"PARITY control, eos-leaning x{requests} with min_frames=0: frames {[len(c) for c in control]} "
          f"vs official {[len(c) for c in codes]}")
    assert [len(c) for c in control] != [len(c) for c in codes], "min length decides nothing: the check is blind"


GQA = [(4, 2), (8, 2), (16, 8)]
BI_LAYOUTS = [LAYOUTS[2], LAYOUTS[-2]]  # stream+spk+lang, icl+stream(text<=ref)


@pytest.fixture(scope="module")
def gqa_ckpts(tmp_path_factory) -> dict[tuple[int, int], Checkpoint]:
    root = tmp_path_factory.mktemp("gqa")
    return {hk: Checkpoint(root / f"h{hk[0]}kv{hk[1]}", *hk, seed=hk[0]) for hk in GQA}


@pytest.mark.parametrize("layout", BI_LAYOUTS, ids=[lo.name for lo in BI_LAYOUTS])
@pytest.mark.parametrize("heads", GQA, ids=[f"gqa{h}/{kv}" for h, kv in GQA])
@pytest.mark.parametrize("bi", [True, False], ids=["batch-invariant", "blas"])
def test_gqa_shapes(gqa_ckpts, heads, layout, bi):
    ckpt = gqa_ckpts[heads]
    model = ckpt.load_ours(batch_invariant=bi)
    samples = two_samples(layout)
    codes, captured = run_official(ckpt, samples, user_id(model))
    tag = f"{'bi' if bi else 'blas'} gqa{heads[0]}/{heads[1]} {layout.name}"
    for row, sample in enumerate(samples):
        compare_logits(ckpt.load_ours(batch_invariant=bi), sample, codes[row], captured, row, f"{tag} x2[{row}]")
    ours = engine_codes(model, samples)
    for row in range(2):
        same_codes(ours[row], codes[row], f"{tag} x2[{row}] greedy {FRAMES} frames", cb0_margin(captured, row, codes[row]))


# ---------------------------------------------------------------- reverse: our checkpoint in the official class


@pytest.fixture(scope="module")
def ours_saved(tmp_path_factory):
    cfg = tiny_config(batch_invariant=False, demo_eos_wiring=False, spk_id=SPK_ID, spk_is_dialect=SPK_IS_DIALECT,
                      codec_language_id=LANGUAGE_ID)
    model = Qwen3TTSTalker(cfg, seed=0, dtype=DTYPE)
    redraw(model.module.named_parameters(), seed=7)
    directory = tmp_path_factory.mktemp("ours") / "tiny"
    save_checkpoint(model, directory)
    return model, directory


def test_saved_checkpoint_has_what_official_from_pretrained_reads(ours_saved):
    """`Qwen3TTSForConditionalGeneration.from_pretrained` also opens generation_config.json (a
    required file) and speech_tokenizer/ (the codec: a separate model, not the talker's)."""
    _, directory = ours_saved
    assert (directory / "generation_config.json").is_file(), (
        "save_checkpoint wrote no generation_config.json; the official from_pretrained requires it "
        f"(files written: {sorted(p.name for p in directory.iterdir())})")


def test_reverse_official_class_loads_our_checkpoint(ours_saved, tmp_path):
    model, directory = ours_saved
    view = tmp_path / "with-codec"
    shutil.copytree(directory, view)
    # The speech tokenizer (codec) is not part of a talker checkpoint; the official loader opens it
    # after the talker weights (the placeholder class of parity_support stands in for it).
    (view / "speech_tokenizer").mkdir()
    (view / "speech_tokenizer" / "config.json").write_text("{}\n")
    if not (view / "generation_config.json").exists():  # reported by the test above
        (view / "generation_config.json").write_text(json.dumps({"do_sample": False}) + "\n")
    official = official_modeling.Qwen3TTSForConditionalGeneration.from_pretrained(
        str(view), local_files_only=True, torch_dtype=DTYPE).eval()
    ours_state = model.module.state_dict()
    theirs = official.state_dict()
    assert sorted(theirs) == sorted(ours_state), (
        f"official-only keys {sorted(set(theirs) - set(ours_state))}, ours-only {sorted(set(ours_state) - set(theirs))}")
    worst = max((theirs[k].double() - ours_state[k].double()).abs().max().item() for k in theirs)
    record("reverse: weights (max |diff| of any parameter)", worst, None, None)
    record_load("Qwen3-TTS", "our checkpoint -> official from_pretrained: every tensor, bit-identical", worst == 0.0)
    assert worst == 0.0, f"weights differ after the official load by up to {worst:.3g}"
    for layout in (LAYOUTS[2], LAYOUTS[8], LAYOUTS[10]):  # speaker+language, instruct non-streaming, ICL
        sample = Sample.draw(layout, seed=5)
        codes, captured = official_generate(official, model.config, [sample], 9, user_token_id=user_id(model))
        fresh = load_checkpoint(directory, dtype=DTYPE)
        compare_logits(fresh, sample, codes[0], captured, 0, f"reverse {layout.name}")
