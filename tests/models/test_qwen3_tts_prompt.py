"""Qwen3-TTS prompt layouts (streaming, non-streaming, instruct, names, dialect, x-vector, ICL) and their errors."""

from __future__ import annotations

import pytest
import torch

from models.qwen3_tts import Qwen3TTSTalker, TTSInputs, config_1_7b, tiny_config
from models.qwen3_tts.prompt import instruct_template_ids

TEXT = [72, 101, 108, 108, 111]  # "Hello"
Q = 16


@pytest.fixture(scope="module")
def model() -> Qwen3TTSTalker:
    return Qwen3TTSTalker(tiny_config(), seed=0)


def official(model: Qwen3TTSTalker, text: list[int], *, instruct: list[int] | None = None,
             speaker: torch.Tensor | None = None, language_id: int | None = None,
             ref_text: list[int] | None = None, ref_codes: torch.Tensor | None = None,
             non_streaming: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream generate / generate_icl_prompt restated for one sample: it slices the fully
    templated ids like upstream does, and sums reference codebooks with one reduction."""
    cfg, t = model.config, model.talker
    im_start, im_end, assistant, nl = (cfg.im_start_token_id, cfg.im_end_token_id, cfg.assistant_token_id,
                                       cfg.newline_token_id)

    def T(ids):
        return t.text_projection(t.model.text_embedding(torch.tensor(ids, dtype=torch.long)))

    def C(ids):
        return t.model.codec_embedding(torch.tensor(ids, dtype=torch.long))

    full = [im_start, assistant, nl] + text + [im_end, nl, im_start, assistant, nl]
    bos, eos, pad = T([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id])
    if language_id is None:
        tags = [cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id]
    else:
        tags = [cfg.codec_think_id, cfg.codec_think_bos_id, language_id, cfg.codec_think_eos_id]
    codec = [C(tags)] + ([speaker.view(1, -1)] if speaker is not None else []) + [C([cfg.codec_pad_id,
                                                                                   cfg.codec_bos_id])]
    codec = torch.cat(codec)
    text_side = torch.cat([pad.expand(codec.shape[0] - 2, -1), bos[None]])
    rows = torch.cat([T(full[:3]), text_side + codec[:-1]])
    if ref_codes is not None:
        ref_full = [im_start, assistant, nl] + ref_text + [im_end, nl]
        text_col = torch.cat([T(ref_full[3:-2] + full[3:-5]), eos[None]])
        per_book = [t.model.codec_embedding(ref_codes[:, 0])]
        per_book += [t.code_predictor.model.codec_embedding[g - 1](ref_codes[:, g]) for g in range(1, Q)]
        codec_col = torch.cat([C([cfg.codec_bos_id]), torch.stack(per_book, 1).sum(1)])
        lt, lc = text_col.shape[0], codec_col.shape[0]
        if non_streaming:
            tail = torch.cat([text_col + C([cfg.codec_pad_id] * lt), codec_col + pad])
            trailing = pad[None]
        elif lt > lc:
            tail, trailing = text_col[:lc] + codec_col, text_col[lc:]
        else:
            tail = torch.cat([text_col] + [pad[None]] * (lc - lt)) + codec_col
            trailing = pad[None]
        rows = torch.cat([rows, tail])
    else:
        rows = torch.cat([rows, T(full[3:4]) + codec[-1:]])
        if non_streaming:
            body = torch.cat([T(full[3:-5]), eos[None]]) + C([cfg.codec_pad_id] * (len(full[3:-5]) + 1))
            rows = torch.cat([rows[:-1], body, pad[None] + C([cfg.codec_bos_id])])
            trailing = pad[None]
        else:
            trailing = torch.cat([T(full[4:-5]), eos[None]])
    if instruct is not None:
        rows = torch.cat([T(instruct), rows])
    return rows, trailing


def assert_layout(model, inputs: TTSInputs, **expected) -> None:
    p = model.prepare(inputs)
    prompt, trailing = official(model, **expected)
    assert p.prompt_embeds.shape == prompt.shape
    torch.testing.assert_close(p.prompt_embeds, prompt)
    torch.testing.assert_close(p.columns["trailing_text"], trailing)
    assert int(p.columns["trailing_len"]) == trailing.shape[0]


def instruct_ids(text: str) -> list[int]:
    # The byte tokenizer's stand-in for "<|im_start|>user\n{text}<|im_end|>\n".
    return [256, 262, 10] + list(text.encode()) + [257, 10]


def xvec(seed: int = 1) -> torch.Tensor:
    return torch.randn(64, generator=torch.Generator().manual_seed(seed))


def codes(frames: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 2048, (frames, Q), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("non_streaming", [False, True])
@pytest.mark.parametrize("case", ["plain", "speaker", "speaker_id", "language", "language_id", "instruct",
                                  "instruct_speaker", "xvector", "xvector_language", "one_token"])
def test_layouts_match_the_official_builder(model, case, non_streaming):
    cfg = model.config
    text = [72] if case == "one_token" else TEXT
    kw, ref = {}, {}
    if case in ("speaker", "instruct_speaker"):
        kw["speaker"], ref["speaker"] = "Vivian", model.talker.model.codec_embedding.weight[3065]
    if case == "speaker_id":
        kw["speaker_id"], ref["speaker"] = 3000, model.talker.model.codec_embedding.weight[3000]
    if case in ("language", "xvector_language"):
        kw["language"], ref["language_id"] = "English", 2050
    if case == "language_id":
        kw["language_id"], ref["language_id"] = 2200, 2200
    if case.startswith("instruct"):
        kw["instruct"], ref["instruct"] = "Speak slowly.", instruct_ids("Speak slowly.")
    if case.startswith("xvector"):
        kw["speaker_embedding"] = ref["speaker"] = xvec()
    assert cfg.spk_id["vivian"] == 3065 and cfg.codec_language_id["english"] == 2050
    inputs = TTSInputs(text_ids=text, non_streaming=non_streaming, **kw)
    assert_layout(model, inputs, text=text, non_streaming=non_streaming, **ref)


@pytest.mark.parametrize("non_streaming", [False, True])
@pytest.mark.parametrize("frames", [2, 5, 12])  # text column longer, equal-ish, shorter than the codes
def test_icl_layout_matches_generate_icl_prompt(model, frames, non_streaming):
    ref_text, ref_codes, spk = [82, 101, 102], codes(frames), xvec()
    inputs = TTSInputs(text_ids=TEXT, speaker_embedding=spk, ref_text_ids=ref_text, ref_codes=ref_codes,
                       non_streaming=non_streaming)
    assert_layout(model, inputs, text=TEXT, speaker=spk, ref_text=ref_text, ref_codes=ref_codes,
                  non_streaming=non_streaming)
    # L = 3 + 5 + 1 = 9 text rows against frames + 1 codec rows.
    trailing = model.prepare(inputs).columns["trailing_text"].shape[0]
    assert trailing == (1 if non_streaming or frames + 1 >= 9 else 9 - (frames + 1))


def test_icl_with_instruct_and_language(model):
    ref_codes, spk = codes(3), xvec(5)
    inputs = TTSInputs(text="Hi there", ref_text="Ref", ref_codes=ref_codes, speaker_embedding=spk,
                       language="chinese", instruct="Whisper")
    assert_layout(model, inputs, text=list(b"Hi there"), ref_text=list(b"Ref"), ref_codes=ref_codes,
                  speaker=spk, language_id=2055, instruct=instruct_ids("Whisper"))


def test_strings_tokenize_like_their_ids(model):
    a = model.prepare(TTSInputs(text="Hey", instruct="Loud", speaker_embedding=xvec(), ref_text="Ab",
                                ref_codes=codes(2)))
    b = model.prepare(TTSInputs(text_ids=list(b"Hey"), instruct_ids=list(b"Loud"), speaker_embedding=xvec(),
                                ref_text_ids=list(b"Ab"), ref_codes=codes(2)))
    assert torch.equal(a.prompt_embeds, b.prompt_embeds)
    assert torch.equal(a.columns["trailing_text"], b.columns["trailing_text"])


def test_empty_instruct_means_none(model):
    plain = model.prepare(TTSInputs(text_ids=TEXT)).prompt_embeds
    for kw in ({"instruct": ""}, {"instruct_ids": []}):
        assert torch.equal(model.prepare(TTSInputs(text_ids=TEXT, **kw)).prompt_embeds, plain)


def test_empty_speaker_means_none_and_numpy_ids_are_ints(model):
    import numpy as np

    plain = model.prepare(TTSInputs(text_ids=TEXT)).prompt_embeds
    assert torch.equal(model.prepare(TTSInputs(text_ids=TEXT, speaker="")).prompt_embeds, plain)
    assert torch.equal(model.prepare(TTSInputs(text_ids=np.array(TEXT))).prompt_embeds, plain)
    with_id = model.prepare(TTSInputs(text_ids=TEXT, speaker_id=np.int64(3065))).prompt_embeds
    assert torch.equal(with_id, model.prepare(TTSInputs(text_ids=TEXT, speaker="vivian")).prompt_embeds)


def test_inputs_compare_tensors_by_value():
    assert TTSInputs(text="a", speaker_embedding=xvec(1)) == TTSInputs(text="a", speaker_embedding=xvec(1))
    assert TTSInputs(text="a", speaker_embedding=xvec(1)) != TTSInputs(text="a", speaker_embedding=xvec(2))
    assert TTSInputs(text="a", speaker_embedding=xvec(1)) != TTSInputs(text="a")
    assert hash(TTSInputs(text="a", language="english")) == hash(TTSInputs(text="a", language="english"))


def test_instruct_template_of_the_qwen_tokenizer():
    cfg = config_1_7b()
    assert cfg.user_token_id == 872
    assert instruct_template_ids(cfg, [9707]) == [151644, 872, 198, 9707, 151645, 198]


@pytest.mark.parametrize("speaker,language,expected", [
    ("eric", None, 2062), ("Eric", "auto", 2062), ("eric", "Chinese", 2062),  # dialect override
    ("eric", "english", 2050), ("vivian", "chinese", 2055), ("vivian", None, None), (None, "AUTO", None),
])
def test_language_resolution_and_dialect_override(model, speaker, language, expected):
    inputs = TTSInputs(text_ids=TEXT, speaker=speaker, language=language)
    spk = None if speaker is None else model.talker.model.codec_embedding.weight[model.config.spk_id[speaker.lower()]]
    assert_layout(model, inputs, text=TEXT, speaker=spk, language_id=expected)


def test_numeric_speaker_id_has_no_dialect_override(model):
    eric = model.config.spk_id["eric"]
    assert_layout(model, TTSInputs(text_ids=TEXT, speaker_id=eric), text=TEXT,
                  speaker=model.talker.model.codec_embedding.weight[eric], language_id=None)


@pytest.mark.parametrize("kwargs,message", [
    (dict(text="a", text_ids=[1]), "exactly one of text and text_ids"),
    (dict(), "exactly one of text and text_ids"),
    (dict(text="a", speaker="vivian", speaker_id=3), "speaker, speaker_id"),
    (dict(text="a", speaker="vivian", speaker_embedding=torch.zeros(64)), "speaker_embedding"),
    (dict(text="a", language="english", language_id=2050), "language, language_id"),
    (dict(text="a", instruct="x", instruct_ids=[1]), "instruct, instruct_ids"),
    (dict(text="a", ref_text="x", ref_text_ids=[1], ref_codes=codes(1), speaker_embedding=xvec()), "ref_text_ids"),
    (dict(text="a", ref_codes=codes(1), speaker_embedding=xvec()), "only ref_codes"),
    (dict(text="a", ref_text="x", speaker_embedding=xvec()), "only the reference text"),
    (dict(text="a", ref_text="x", ref_codes=codes(1)), "needs speaker_embedding"),
    (dict(text="a", non_streaming=1), "non_streaming must be a bool"),
    (dict(text=b"a"), "text must be a str"),
    (dict(text="a", speaker=7), "speaker must be a str"),
])
def test_bad_combinations(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TTSInputs(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(text=""), "text: empty"),
    (dict(text_ids=[]), "text: empty"),
    (dict(text_ids=[600]), r"text_ids: ids outside the text vocab \[0, 512\)"),
    (dict(text_ids=[1.5]), "text_ids: .* not ints"),
    (dict(text="a", instruct_ids=[-1]), "instruct_ids: ids outside"),
    (dict(text="a", speaker="nobody"), "speaker='nobody' is not known.*known: eric, vivian"),
    (dict(text="a", language="klingon"), "language='klingon' is not known.*known: chinese, english, "
                                         "sichuan_dialect, auto"),
    (dict(text="a", speaker_id=3072), r"speaker_id=3072 is not an id in the codec vocab \[0, 3072\)"),
    (dict(text="a", language_id=True), "language_id=True is not an id"),
    (dict(text="a", speaker_embedding=torch.zeros(63)), r"speaker_embedding must have shape \[64\]"),
    (dict(text="a", speaker_embedding=torch.zeros(1, 64)), r"speaker_embedding must have shape \[64\]"),
    (dict(text="a", speaker_embedding=torch.zeros(64, dtype=torch.int64)), "speaker_embedding must have a floating"),
    (dict(text="a", speaker_embedding=[0.0] * 64), "speaker_embedding must be a torch.Tensor"),
    (dict(text="a", speaker_embedding=torch.full((64,), float("nan"))), "speaker_embedding holds NaN"),
    (dict(text="a", speaker_embedding=xvec(), ref_text="r", ref_codes=codes(2).float()), "ref_codes must have an int"),
    (dict(text="a", speaker_embedding=xvec(), ref_text="r", ref_codes=codes(2)[:, :15]), r"shape \[T, 16\]"),
    (dict(text="a", speaker_embedding=xvec(), ref_text="r", ref_codes=codes(2)[0]), r"shape \[T, 16\]"),
    (dict(text="a", speaker_embedding=xvec(), ref_text="r", ref_codes=torch.zeros(0, 16, dtype=torch.long)),
     "T >= 1"),
    (dict(text="a", speaker_embedding=xvec(), ref_text="r", ref_codes=torch.full((2, 16), 2048)),
     r"ref_codes holds 32 codes outside the codebook \[0, 2048\), first 2048 at frame 0, codebook 0"),
    (dict(text="a", speaker_embedding=xvec(), ref_text="", ref_codes=codes(2)), "ref_text: empty"),
    (dict(text="a", speaker_embedding=xvec(), ref_text_ids=[], ref_codes=codes(2)), "ref_text: empty"),
    (dict(text="x" * 300), "text too long"),
    (dict(text="a", speaker_embedding=xvec(), ref_text="r", ref_codes=codes(600)), "max_context 512"),
])
def test_bad_inputs_are_value_errors_naming_the_field(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.prepare(TTSInputs(**kwargs))


def test_string_fields_need_a_tokenizer():
    model = Qwen3TTSTalker(tiny_config(text_tokenizer="qwen"), seed=0)
    for kw, name in ((dict(text="a"), "text_ids"), (dict(text_ids=[1], instruct="calm"), "instruct_ids"),
                     (dict(text_ids=[1], ref_text="r", ref_codes=codes(1), speaker_embedding=xvec()), "ref_text_ids")):
        with pytest.raises(ValueError, match=f"pass {name} instead"):
            model.prepare(TTSInputs(**kw))


def test_small_custom_voice_model_refuses_instruct():
    model = Qwen3TTSTalker(tiny_config(tts_model_size="0b6"), seed=0)
    with pytest.raises(ValueError, match="instruct: the 0.6B CustomVoice"):
        model.prepare(TTSInputs(text="a", instruct="calm"))
    model.prepare(TTSInputs(text="a", instruct=""))  # empty = no instruction, allowed


LAYOUTS = {
    "streaming": dict(),
    "non_streaming": dict(non_streaming=True),
    "custom_voice": dict(speaker="eric", instruct="Cheerful", non_streaming=True),
    "voice_design": dict(instruct="A deep voice", language="english"),
    "xvector": dict(speaker_embedding=xvec()),
    "icl": dict(speaker_embedding=xvec(), ref_text="Ref words", ref_codes=codes(4)),
    "icl_non_streaming": dict(speaker_embedding=xvec(), ref_text="Ref", ref_codes=codes(6), non_streaming=True),
}


def test_every_layout_runs_through_the_engine():
    from mtp_fsm.engine.engine import LockstepEngine
    from mtp_fsm.engine.plan import NewRequest
    from mtp_fsm.errors import AdmissionError
    from mtp_fsm.lifecycle.spec import FinishReason
    from mtp_fsm.sampling import SamplingParams

    model = Qwen3TTSTalker(tiny_config(), seed=0)
    engine = LockstepEngine(model, 4)
    sampling = SamplingParams(temperature=0.9, top_k=50)
    requests = [NewRequest(name, TTSInputs(text="Hello there.", **kw), max_frames=40, seed=i,
                           cb0_sampling=sampling, mtp_sampling=sampling)
                for i, (name, kw) in enumerate(LAYOUTS.items())]
    results = engine.generate(requests)
    for name, gen in results.items():
        assert gen.finished is not None, name
        assert gen.finished.reason in (FinishReason.EOS, FinishReason.LENGTH), (name, gen.finished)
        # Non-streaming prompts end on tts_pad, which the tiny model reads as "text done": EOS may
        # come at once (unless the engine holds it back for min_frames).
        assert len(gen.frames) == gen.finished.num_frames, name
        assert ((gen.codes() >= 0) & (gen.codes() < 2048)).all(), name
    # The streaming layouts feed the text one token per frame, so EOS waits for the text to end.
    assert len(results["streaming"].frames) == len("Hello there.") + 1
    bad = NewRequest("bad-voice", TTSInputs(text="Hi", speaker="nobody"), max_frames=5)
    with pytest.raises(AdmissionError, match="bad-voice.*speaker='nobody'"):
        engine.add_request(bad)
