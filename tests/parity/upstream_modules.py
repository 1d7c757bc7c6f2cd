"""vllm-omni 0.30.0's engine-independent MOSS-TTS Local and Higgs Audio v3 code, imported from its
unpacked wheel without vLLM (shared by test_moss_tts_local_parity.py and test_higgs_audio_v3_parity.py).

`make parity` downloads the wheel (`pip download --no-deps vllm-omni==0.30.0`) and unpacks it under
.venv-parity-omni/upstream/vllm-omni-src; it is never installed (its pins would replace torch and
transformers, and its talkers run only inside a vLLM engine). What runs here is upstream's own files,
unmodified:

  * MOSS-TTS Local: model_executor/models/moss_tts/configuration_moss_tts.py (the config class),
    modeling_moss_tts_local_depth.py (the local depth transformer, its `generate_frame`) and
    modeling_moss_tts_talker.py's `MossTTSLocalTalkerForGeneration` (its real `__init__`, its
    `preprocess` / `_audio_embed` / `talker_mtp` / `compute_logits` and `load_weights`);
  * Higgs Audio v3: transformers_utils/configs/higgs_audio_v3.py (the config class) and
    higgs_audio_v3_talker.py's `HiggsAudioV3TalkerForConditionalGeneration` (its real `__init__`,
    fused embedding and head, `embed_input_ids` with the audio feedback, `compute_logits`, the
    model-owned `sample` with the delay-pattern masking and EOC wind-down state, `postprocess`,
    `load_weights` / `_map_weight_name` / the required-key check).

The package `__init__` files (which import vLLM, msgspec, the platform plugins) are skipped: the
packages are registered empty over the unpacked folders. The names those files import from vLLM
are provided here, as stand-ins for the engine:

  * `Qwen3Model` (vllm.model_executor.models.qwen3): transformers 5.24.0's `Qwen3Model` built from
    the same text config (vLLM's Qwen3 is that model with fused kernels; in float32 on the CPU
    both are the reference maths), with a `load_weights` taking the checkpoint's HF names;
  * `ParallelLMHead`: a bias-free [vocab, hidden] weight; `LogitsProcessor`: hidden @ head.T;
  * `default_weight_loader`: shape check + copy (what vLLM's does for an unsharded tensor);
    `AutoWeightsLoader` / `WeightsMapper` (Higgs' backbone): load by name, skipping the mapped-away
    prefixes;
  * `apply_top_k_top_p`: identity (only reached with top-k = vocab and top-p = 1 here, where
    vLLM's is the identity too); `SamplerOutput`: the two fields the talkers read;
  * a stock sampler (Higgs' text channel, prefill only): argmax of the text logits;
  * `init_logger`, `current_platform` / `current_omni_platform` (no NPU, no inductor), `OmniOutput`,
    `IntermediateTensors`, `VllmConfig`, `SamplingMetadata`: names only;
  * vllm_omni's `common.qwen3_code_predictor` (the Realtime variant's base class, not under test):
    a placeholder.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import logging
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from parity_support import upstream_dir

VLLM_OMNI = "vllm-omni-src"
BOSON = "boson-src"


def _module(name: str, **attributes) -> types.ModuleType:
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name, "stand-in (tests/parity/upstream_modules.py)")
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        sys.modules[name] = module
        if "." in name:
            parent, _, leaf = name.rpartition(".")
            setattr(_module(parent), leaf, module)
    module.__dict__.update(attributes)
    return module


def _package(name: str, folder: Path) -> None:
    """An upstream package registered empty over its unpacked folder (its __init__ not run)."""
    if name in sys.modules and getattr(sys.modules[name], "__path__", None) == [str(folder)]:
        return
    module = types.ModuleType(name, f"{name} (package body skipped by tests/parity/upstream_modules.py)")
    module.__path__ = [str(folder)]
    module.__file__ = str(folder / "__init__.py")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__spec__.submodule_search_locations = [str(folder)]
    sys.modules[name] = module
    if "." in name:
        parent, _, leaf = name.rpartition(".")
        setattr(sys.modules[parent], leaf, module)


class _Logger(logging.LoggerAdapter):
    def warning_once(self, *args, **kwargs):
        self.warning(*args, **kwargs)

    def info_once(self, *args, **kwargs):
        self.info(*args, **kwargs)

    def debug_once(self, *args, **kwargs):
        self.debug(*args, **kwargs)


def init_logger(name: str) -> _Logger:
    return _Logger(logging.getLogger(name), {})


class _Platform:
    def is_npu(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return False

    def supports_torch_inductor(self) -> bool:
        return False


class Placeholder:
    """A vLLM name the code under test imports but never calls."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__} is a placeholder: the code under test should not build it")


def _placeholder(name: str) -> type:
    return type(name, (Placeholder,), {})


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def _stand_in_qwen3():
    import transformers

    class Qwen3Model(transformers.Qwen3Model):
        """vLLM's Qwen3Model stood in for by transformers' (same maths), built from the text config."""

        def __init__(self, *, vllm_config, prefix: str = ""):
            hf = vllm_config.model_config.hf_config
            text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
            super().__init__(text)

        def load_weights(self, weights) -> set[str]:
            params = dict(self.named_parameters())
            loaded = set()
            for name, tensor in weights:
                default_weight_loader(params[name], tensor)
                loaded.add(name)
            return loaded

    return Qwen3Model


class ParallelLMHead(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, prefix: str = "", **_: Any):
        super().__init__()
        assert not bias
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, *args, **kwargs):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, lm_head: nn.Module, hidden: torch.Tensor, *args) -> torch.Tensor:
        return hidden @ lm_head.weight.t()


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    logprobs_tensors: Any = None


class WeightsMapper:
    def __init__(self, orig_to_new_prefix: dict[str, str | None] | None = None, **_: Any):
        self.orig_to_new_prefix = orig_to_new_prefix or {}


class AutoWeightsLoader:
    def __init__(self, module: nn.Module, **_: Any):
        self.module = module

    def load_weights(self, weights, mapper: WeightsMapper | None = None) -> set[str]:
        params = dict(self.module.named_parameters())
        loaded = set()
        for name, tensor in weights:
            prefixes = mapper.orig_to_new_prefix if mapper else {}
            if any(name.startswith(p) and new is None for p, new in prefixes.items()):
                continue
            default_weight_loader(params[name], tensor)
            loaded.add(name)
        return loaded


def greedy_stock_sampler(logits: torch.Tensor, sampling_metadata: Any) -> SamplerOutput:
    return SamplerOutput(sampled_token_ids=logits.argmax(-1, keepdim=True))


def greedy_metadata(rows: int = 1):
    """What the talkers read from vLLM's SamplingMetadata for an all-greedy batch."""
    return types.SimpleNamespace(all_greedy=True, temperature=None, top_k=None, top_p=None, generators={},
                                 max_num_logprobs=None, allowed_token_ids_mask=None, bad_words_token_ids=None)


def _install_stand_ins() -> None:
    if "vllm" in sys.modules and not getattr(sys.modules["vllm"], "__stand_in__", False):
        pytest.skip("a real vLLM is importable here: this module stands in for it only in .venv-parity-omni",
                    allow_module_level=True)
    _module("vllm", __stand_in__=True)
    _module("vllm.config", VllmConfig=_placeholder("VllmConfig"))
    _module("vllm.logger", init_logger=init_logger)
    _module("vllm.model_executor.layers.logits_processor", LogitsProcessor=LogitsProcessor)
    _module("vllm.model_executor.layers.vocab_parallel_embedding", ParallelLMHead=ParallelLMHead,
            VocabParallelEmbedding=_placeholder("VocabParallelEmbedding"))
    _module("vllm.model_executor.model_loader.weight_utils", default_weight_loader=default_weight_loader)
    _module("vllm.model_executor.models.qwen3", Qwen3Model=_stand_in_qwen3())
    _module("vllm.model_executor.models.utils", AutoWeightsLoader=AutoWeightsLoader, WeightsMapper=WeightsMapper)
    _module("vllm.platforms", current_platform=_Platform())
    _module("vllm.sequence", IntermediateTensors=_placeholder("IntermediateTensors"))
    _module("vllm.v1.outputs", SamplerOutput=SamplerOutput)
    _module("vllm.v1.sample.metadata", SamplingMetadata=_placeholder("SamplingMetadata"))
    _module("vllm.v1.sample.ops.topk_topp_sampler", apply_top_k_top_p=lambda x, k, p: x)


def vllm_omni_modules(*names: str) -> list[types.ModuleType]:
    """The named vllm_omni modules (dotted, without the `vllm_omni.` prefix), from the unpacked wheel."""
    root = upstream_dir(VLLM_OMNI) / "vllm_omni"
    pytest.importorskip("transformers")
    _install_stand_ins()
    for package in ("", ".model_executor", ".model_executor.models", ".model_executor.models.moss_tts",
                    ".model_executor.models.higgs_audio_v3", ".model_executor.models.common",
                    ".transformers_utils", ".transformers_utils.configs"):
        _package(f"vllm_omni{package}", root.joinpath(*package.split(".")[1:]) if package else root)
    _module("vllm_omni.platforms", current_omni_platform=_Platform())
    _module("vllm_omni.model_executor.models.output_templates", OmniOutput=_placeholder("OmniOutput"))
    _module("vllm_omni.model_executor.models.common.qwen3_code_predictor",
            CodePredictorBaseModel=type("CodePredictorBaseModel", (nn.Module,), {}))
    return [importlib.import_module(f"vllm_omni.{name}") for name in names]


def boson_source(relative: str) -> Path:
    """A file of boson-multimodal's unpacked wheel (never imported as a package: it pins transformers < 4.47)."""
    path = upstream_dir(BOSON) / "boson_multimodal" / relative
    if not path.is_file():
        pytest.skip(f"{path} missing from the unpacked boson-multimodal wheel", allow_module_level=True)
    return path
