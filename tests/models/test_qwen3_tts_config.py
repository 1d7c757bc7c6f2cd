"""Qwen3-TTS config: speaker/language maps, config.json round trips, defaults, unsupported fields."""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from models.qwen3_tts import Qwen3TTSConfig, Qwen3TTSTalker, load_checkpoint, save_checkpoint
from models.qwen3_tts.config import (
    RELEASED_CODEC_LANGUAGE_ID,
    RELEASED_SPK_ID,
    UnsupportedConfigError,
    config_0_6b,
    config_1_7b,
    tiny_config,
)

MAPS = ("spk_id", "spk_is_dialect", "codec_language_id")


def json_round_trip(cfg: Qwen3TTSConfig) -> Qwen3TTSConfig:
    return Qwen3TTSConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())))


def released_file(cfg: Qwen3TTSConfig | None = None) -> dict:
    """A config.json as released: no engine block."""
    data = json.loads(json.dumps((cfg or config_1_7b()).to_hf_dict()))
    del data["mtp_fsm"]
    return data


# ---- the maps ------------------------------------------------------------------------------


def test_tiny_maps_are_small_valid_and_clear_of_special_ids():
    cfg = tiny_config()
    assert len(cfg.spk_id) == 2 and set(cfg.codec_language_id) >= {"english", "chinese"}
    dialects = [d for d in cfg.spk_is_dialect.values() if d is not False]
    assert len(dialects) == 1 and dialects[0] in cfg.codec_language_id
    specials = {cfg.codec_pad_id, cfg.codec_bos_id, cfg.codec_eos_token_id, cfg.codec_think_id,
                cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id}
    ids = [*cfg.spk_id.values(), *cfg.codec_language_id.values()]
    assert len(set(ids)) == len(ids) and not set(ids) & specials
    assert all(cfg.codebook_size <= i < cfg.vocab_size for i in ids)


def test_presets_carry_the_released_maps():
    for cfg in (config_1_7b(), config_0_6b()):
        assert dict(cfg.spk_id) == RELEASED_SPK_ID and len(cfg.spk_id) == 9
        assert dict(cfg.codec_language_id) == RELEASED_CODEC_LANGUAGE_ID
        assert cfg.spk_is_dialect["eric"] == "sichuan_dialect" and cfg.spk_is_dialect["vivian"] is False
    assert Qwen3TTSConfig().spk_id == {}  # the bare class offers no speakers


@pytest.mark.parametrize("make", [tiny_config, config_1_7b, config_0_6b])
def test_maps_round_trip_through_hf_dict(make):
    cfg = make()
    data = cfg.to_hf_dict()
    talker = data["talker_config"]
    assert all(type(talker[k]) is dict for k in MAPS)  # plain JSON objects
    assert data["tts_model_type"] == "custom_voice" and data["tokenizer_type"] == "qwen3_tts_tokenizer_12hz"
    back = json_round_trip(cfg)
    assert back == cfg and all(getattr(back, k) == getattr(cfg, k) for k in MAPS)


def test_maps_round_trip_through_a_checkpoint(tmp_path):
    cfg = tiny_config(spk_id={"vivian": 3065, "eric": 2875, "solo": 3000},
                      spk_is_dialect={"vivian": False, "eric": "sichuan_dialect"})
    save_checkpoint(Qwen3TTSTalker(cfg, seed=1), tmp_path)
    # Upstream's from_pretrained also requires generation_config.json (its sampling defaults).
    assert json.loads((tmp_path / "generation_config.json").read_text())["subtalker_top_k"] == 50
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == cfg
    assert loaded.config.spk_id["solo"] == 3000 and loaded.config.spk_is_dialect["eric"] == "sichuan_dialect"


def test_file_maps_absent_null_or_listed():
    data = released_file()
    for k in MAPS:
        del data["talker_config"][k]
    assert all(getattr(Qwen3TTSConfig.from_hf_dict(data), k) == {} for k in MAPS)
    for k in MAPS:
        data["talker_config"][k] = None
    assert Qwen3TTSConfig.from_hf_dict(data).spk_id == {}
    # Some exported files write each speaker id as a one-element list.
    data["talker_config"]["spk_id"] = {"ryan": [3061], "aiden": 2861}
    assert Qwen3TTSConfig.from_hf_dict(data).spk_id == {"ryan": 3061, "aiden": 2861}


def test_config_stays_frozen_hashable_and_copyable():
    cfg = config_1_7b()
    assert hash(cfg) == hash(config_1_7b()) and cfg == config_1_7b()
    assert hash(cfg) != hash(config_1_7b(spk_id={"ryan": 3061}))
    with pytest.raises(TypeError):
        cfg.spk_id["new"] = 1
    with pytest.raises(TypeError):
        cfg.codec_language_id.update(x=1)
    source = {"vivian": 3065}
    owned = tiny_config(spk_id=source, spk_is_dialect={})
    source["other"] = 1  # the config copied the caller's dict
    assert owned.spk_id == {"vivian": 3065}
    assert copy.deepcopy(cfg) == cfg and pickle.loads(pickle.dumps(cfg)) == cfg
    assert hash(pickle.loads(pickle.dumps(cfg))) == hash(cfg)


@pytest.mark.parametrize("overrides, fragment", [
    (dict(spk_id={"vivian": 3072}), "spk_id['vivian']=3072"),
    (dict(spk_id={"vivian": -1}), "spk_id['vivian']=-1"),
    (dict(spk_id={"vivian": True}), "spk_id['vivian']=True"),
    (dict(codec_language_id={"english": 5000, "sichuan_dialect": 2062}), "codec_language_id['english']=5000"),
    (dict(spk_id={"Vivian": 3065}, spk_is_dialect={}), "spk_id key 'Vivian'"),
    (dict(codec_language_id={"English": 2050, "sichuan_dialect": 2062}), "codec_language_id key 'English'"),
    (dict(spk_is_dialect={"eric": "beijing_dialect"}), "spk_is_dialect['eric']='beijing_dialect'"),
    (dict(spk_is_dialect={"eric": True}), "spk_is_dialect['eric']=True"),
])
def test_invalid_maps_are_rejected(overrides, fragment):
    with pytest.raises(ValueError) as err:
        tiny_config(**overrides)
    assert fragment in str(err.value)


# ---- defaults for fields absent from config.json ------------------------------------------


def test_code_predictor_head_dim_defaults_to_128():
    """Upstream's code-predictor config class defaults head_dim to 128, not hidden / heads."""
    data = released_file()
    cp = data["talker_config"]["code_predictor_config"]
    del cp["head_dim"]
    assert cp["hidden_size"] // cp["num_attention_heads"] == 64  # what the old fallback gave
    assert Qwen3TTSConfig.from_hf_dict(data).code_predictor.head_dim == 128


def test_talker_head_dim_defaults_to_hidden_over_heads():
    """Upstream's talker config has no head_dim default: its attention uses hidden / heads."""
    data = released_file(config_0_6b())
    del data["talker_config"]["head_dim"]
    data["talker_config"]["rope_scaling"]["mrope_section"] = [12, 10, 10]  # head_dim 64
    assert Qwen3TTSConfig.from_hf_dict(data).head_dim == 1024 // 16


# ---- unsupported values are rejected by name -----------------------------------------------

TALKER, CP = "talker_config", "talker_config.code_predictor_config"


def _set(data: dict, where: str, field: str, value) -> None:
    section = data["talker_config"] if where == TALKER else data["talker_config"]["code_predictor_config"]
    section[field] = value


@pytest.mark.parametrize("where", [TALKER, CP])
@pytest.mark.parametrize("field, value, named", [
    ("use_sliding_window", True, "use_sliding_window=True"),
    ("attention_bias", True, "attention_bias=True"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type='yarn'"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling.rope_type='linear'"),
    ("rope_scaling", "default", "rope_scaling='default'"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e6}, "rope_parameters.rope_type='dynamic'"),
])
def test_unsupported_values_are_rejected(where, field, value, named):
    data = released_file()
    _set(data, where, field, value)
    with pytest.raises(UnsupportedConfigError) as err:
        Qwen3TTSConfig.from_hf_dict(data)
    message = str(err.value)
    assert f"{where}.{named}" in message and "supported" in message
    assert isinstance(err.value, ValueError)


def test_malformed_mrope_section_is_rejected():
    data = released_file()
    data["talker_config"]["rope_scaling"]["mrope_section"] = [24, 20, 24]
    with pytest.raises(UnsupportedConfigError, match=r"rope_scaling\.mrope_section=\[24, 20, 24\].*64"):
        Qwen3TTSConfig.from_hf_dict(data)


@pytest.mark.parametrize("where, field, value", [
    (TALKER, "rope_scaling", None),
    (TALKER, "rope_scaling", {"type": "default", "mrope_section": [16, 24, 24], "interleaved": False}),
    (TALKER, "rope_scaling", {"mrope_section": [24, 20, 20], "interleaved": True}),
    (TALKER, "rope_parameters", {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20]}),
    (CP, "rope_scaling", {"rope_type": "default"}),
    (TALKER, "use_sliding_window", False),
    (CP, "attention_bias", False),
    (CP, "hidden_act", "silu"),
])
def test_values_this_model_computes_are_accepted(where, field, value):
    data = released_file()
    _set(data, where, field, value)
    assert Qwen3TTSConfig.from_hf_dict(data).hidden_size == 2048


def test_written_file_declares_the_math_it_implements():
    talker = config_1_7b().to_hf_dict()["talker_config"]
    for section in (talker, talker["code_predictor_config"]):
        assert (section["hidden_act"], section["attention_bias"], section["use_sliding_window"]) == (
            "silu", False, False)
    assert talker["rope_scaling"] == {"rope_type": "default", "mrope_section": [24, 20, 20], "interleaved": True}
    assert talker["code_predictor_config"]["head_dim"] == 128
