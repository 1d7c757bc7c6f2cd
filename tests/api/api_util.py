"""Helpers of the speech API tests: a Qwen3-TTS talker that faults on request, the offline reference, PCM checks."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from models.qwen3_tts import Qwen3TTSTalker, TTSInputs, text_inputs, tiny_config
from models.qwen3_tts.codec import tiny_demo_decoder
from mtp_fsm.engine import LockstepEngine, NewRequest
from mtp_fsm.serving.model_loader import LoadedTalker

# The decoder load_decoder("api_util:...") finds for the talker below: the real tiny Qwen3-TTS one.
CODEC_DECODER = "models.qwen3_tts.codec:tiny_demo_decoder"
FAULT_PREFIX = "FAULT"
TALKER = "api_util:poisoned_tiny_qwen3_tts"


class PoisonedQwen3TTS(Qwen3TTSTalker):
    """The tiny Qwen3-TTS talker, except that a text starting with FAULT gets NaN prompt embeddings:
    its first CB0 sample faults (reason error) in that row only, which is how a model fault for one
    request looks to the engine. Same weights as tiny_demo_talker(seed) for every other text."""

    def prepare(self, inputs: TTSInputs):
        prepared = super().prepare(inputs)
        if isinstance(inputs.text, str) and inputs.text.startswith(FAULT_PREFIX):
            return attrs.evolve(prepared, prompt_embeds=torch.full_like(prepared.prompt_embeds, float("nan")))
        return prepared


def poisoned_tiny_qwen3_tts(seed: int = 0) -> LoadedTalker:
    return LoadedTalker(PoisonedQwen3TTS(tiny_config(), seed=seed), text_inputs, "qwen3_tts")


def offline_codes(requests: list[NewRequest], seed: int = 0) -> dict[str, tuple[list[list[int]], str]]:
    """LockstepEngine.generate on the plain tiny talker: codes and finish reason per request."""
    from models.qwen3_tts import tiny_demo_talker

    engine = LockstepEngine(tiny_demo_talker(seed=seed), max(len(requests), 1), kernels="torch")
    try:
        out = engine.generate(requests)
    finally:
        engine.close()
    return {rid: ([f.codes.tolist() for f in g.frames], g.finished.reason.label) for rid, g in out.items()}


def decoded_pcm16(codes: list[list[int]], seed: int = 0) -> np.ndarray:
    """The whole utterance decoded at once by the tiny decoder, as 16-bit samples (the reference a
    streamed, chunked decode must equal within one step of rounding)."""
    from mtp_fsm.serving.wav import pcm16

    decoder = tiny_demo_decoder(seed=seed)
    with torch.inference_mode():
        samples = decoder.decode(torch.tensor([codes], dtype=torch.int64), True)[0]
    return np.frombuffer(pcm16(samples), dtype="<i2")


def request_for(rid: str, body: dict) -> NewRequest:
    """The NewRequest the server builds for a body (voice -> speaker, language, instructions -> instruct)."""
    inputs = TTSInputs(text=body["input"], speaker=body.get("voice"), language=body.get("language"),
                       instruct=body.get("instructions"))
    return NewRequest(rid, inputs, max_frames=body["max_new_tokens"], seed=body["seed"])
