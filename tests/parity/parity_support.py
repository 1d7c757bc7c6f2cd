"""Shared by the parity tests (imported by conftest.py and the test modules): parity against the official Qwen3-TTS (PyPI qwen-tts==0.1.1): import setup and the diff table.

`make parity` installs qwen-tts with --no-deps into .venv-parity. Its talker lives in
qwen_tts/core/models (configuration_qwen3_tts.py, modeling_qwen3_tts.py), which needs only
transformers, accelerate and librosa. The package's `__init__` files, however, import the whole
inference stack: qwen_tts/__init__ -> inference/qwen3_tts_model.py (soundfile), qwen_tts/core/__init__
-> the 25 Hz / 12 Hz speech tokenizers (torchaudio, sox, onnxruntime, einops). None of that is the
talker, and torchaudio has no build for the CPU torch pin. So, when qwen_tts is installed, this
conftest registers the three packages `qwen_tts`, `qwen_tts.core`, `qwen_tts.inference` as empty
packages pointing at the installed folders (their `__init__` bodies do not run) and the one module
the modeling file imports from the inference stack, `qwen_tts.inference.qwen3_tts_tokenizer`
(the speech tokenizer = the codec, a separate model), as a placeholder. Every other module,
configuration_qwen3_tts.py and modeling_qwen3_tts.py included, is the installed file, unmodified.

Without qwen_tts (the project's own venv, `make test`), nothing is registered and the test
modules skip at import (`pytest.importorskip("qwen_tts")`).

Each check records its max absolute difference in DIFFS; the table is printed at the end of the run.
"""

from __future__ import annotations

import importlib.util
import sys
import types

# what -> (max abs diff, max scaled diff or None, tolerance or None for an exact check)
DIFFS: dict[str, tuple[float, float | None, float | None]] = {}


class _SpeechTokenizerPlaceholder:
    """Stands in for qwen_tts.inference.qwen3_tts_tokenizer.Qwen3TTSTokenizer (the codec wrapper).

    `Qwen3TTSForConditionalGeneration.from_pretrained` loads it from `speech_tokenizer/` after the
    talker weights; the talker never calls it."""

    def __init__(self, path: str | None = None):
        self.path = path

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        return cls(str(path))


def _register_official_skeleton() -> None:
    if "qwen_tts" in sys.modules:
        return
    spec = importlib.util.find_spec("qwen_tts")  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        return
    root = list(spec.submodule_search_locations)[0]
    for name, folder in (("qwen_tts", root), ("qwen_tts.core", f"{root}/core"),
                         ("qwen_tts.inference", f"{root}/inference")):
        module = types.ModuleType(name, f"{name} (package body skipped by tests/parity/conftest.py)")
        module.__path__ = [folder]
        module.__file__ = f"{folder}/__init__.py"
        module.__package__ = name
        module.__spec__ = importlib.util.spec_from_file_location(name, module.__file__,
                                                                 submodule_search_locations=[folder])
        sys.modules[name] = module
        if "." in name:
            parent, _, leaf = name.rpartition(".")
            setattr(sys.modules[parent], leaf, module)
    codec = types.ModuleType("qwen_tts.inference.qwen3_tts_tokenizer", "placeholder: the speech tokenizer (codec)")
    codec.Qwen3TTSTokenizer = _SpeechTokenizerPlaceholder
    sys.modules[codec.__name__] = codec
    sys.modules["qwen_tts.inference"].qwen3_tts_tokenizer = codec


_register_official_skeleton()


def record(what: str, diff: float, scaled: float | None, tol: float | None) -> None:
    """One row of the table: a tensor check (max |diff|, max |diff| / max(1, |official|), tolerance
    on the latter) or an exact one (scaled and tol None; diff = frames or values differing)."""
    old = DIFFS.get(what)
    if old is None or diff >= old[0]:
        DIFFS[what] = (diff, scaled, tol)
