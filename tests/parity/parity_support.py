"""Shared by the parity tests (imported by conftest.py and the test modules): the official Qwen3-TTS's import setup (PyPI qwen-tts==0.1.1) and every talker's rows of the parity table.

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

Each check records its max absolute difference in DIFFS (Qwen3-TTS's detail table) and, for every
talker, a row in RESULTS: tensors (max |diff|, scaled, tolerance), greedy codes (frames identical of
frames compared) and checkpoint loads (ok or not). conftest.py prints this run's rows and, under
`make parity` (PARITY_RESULTS set), writes them to a JSON file; tests/parity/summary.py prints one
table over the runs of every parity venv.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest

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


# Every talker's checks, in the order run: dicts with talker, what, kind ("tensor" | "greedy" |
# "load"), diff / scaled / tol (tensor), same / total (greedy: frames identical of frames compared),
# ok, note.
RESULTS: list[dict] = []
QWEN3_TTS = "Qwen3-TTS"


def record(what: str, diff: float, scaled: float | None, tol: float | None, *, talker: str = QWEN3_TTS) -> None:
    """One row of the table: a tensor check (max |diff|, max |diff| / max(1, |official|), tolerance
    on the latter) or an exact one (scaled and tol None; diff = frames or values differing)."""
    if talker.startswith(QWEN3_TTS):
        old = DIFFS.get(what)
        if old is None or diff >= old[0]:
            DIFFS[what] = (diff, scaled, tol)
    if tol is not None:
        record_tensor(talker, what, diff, scaled if scaled is not None else diff, tol)


def record_tensor(talker: str, what: str, diff: float, scaled: float, tol: float, note: str = "") -> None:
    RESULTS.append(dict(talker=talker, what=what, kind="tensor", diff=float(diff), scaled=float(scaled),
                        tol=float(tol), ok=bool(scaled <= tol), note=note))


def record_greedy(talker: str, what: str, same: int, total: int, note: str = "", *, divergence: str = "") -> None:
    """Greedy codes: `same` leading frames identical of `total` compared (ok iff all). A
    `divergence` names a known, intended difference the test asserted (the row is then a
    documented one, listed apart from the identical runs, not a failure)."""
    RESULTS.append(dict(talker=talker, what=what, kind="greedy", same=int(same), total=int(total),
                        ok=bool(same == total or divergence), note=note, divergence=divergence))


def record_load(talker: str, what: str, ok: bool, note: str = "") -> None:
    RESULTS.append(dict(talker=talker, what=what, kind="load", ok=bool(ok), note=note))


def leading_same(ours, ref) -> int:
    """Frames identical from the start (rows of two [frames, codebooks] code tensors)."""
    n = 0
    for a, b in zip(ours, ref):
        if not bool((a == b).all()):
            break
        n += 1
    return n


def close(talker: str, ours, ref, what: str, tol: float = 1e-5) -> float:
    """Elementwise |ours - ref| <= tol * max(1, |ref|) (relative for large entries, absolute for
    small ones), recorded as a tensor row; returns the max absolute difference."""
    ours, ref = ours.detach().double(), ref.detach().double()
    assert ours.shape == ref.shape, f"{talker} {what}: shape {tuple(ours.shape)} vs upstream {tuple(ref.shape)}"
    diff = (ours - ref).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    scaled = (diff / ref.abs().clamp(min=1.0)).max().item() if diff.numel() else 0.0
    record_tensor(talker, what, worst, scaled, tol)
    print(f"PARITY {talker} {what}: max abs diff {worst:.3e}, scaled {scaled:.3e} "
          f"(upstream max |x| {ref.abs().max().item() if ref.numel() else 0:.3g})")
    assert scaled <= tol, f"{talker} {what}: |diff| / max(1, |upstream|) reaches {scaled:.3e} > {tol:g}"
    return worst


def upstream_dir(name: str):
    """An unpacked upstream wheel of this parity venv (the Makefile puts it under <venv>/upstream),
    or a skip saying why: the main venv (`make test`) has none of them."""
    from pathlib import Path

    path = Path(sys.prefix) / "upstream" / name
    if not path.is_dir():
        pytest.skip(f"{name} not unpacked at {path}: a `make parity` venv holds it (this venv: {sys.prefix})",
                    allow_module_level=True)
    return path


def in_parity_run() -> bool:
    return bool(os.environ.get("PARITY_RESULTS"))
