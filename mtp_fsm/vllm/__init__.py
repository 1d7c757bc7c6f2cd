"""Serving under vLLM: TalkerLLM (vLLM schedules, the engine executes) and vLLM's shapes (token-major outputs).

Nothing here imports vLLM until a vLLM-facing name is used, so the engine runs without it.
"""

from .frame_store import TakenFrames
from .model_dir import TalkerDirConfig, write_model_dir
from .request_codec import RequestCodecError, decode_request, encode_request
from .token_major import TokenMajorFrames, to_token_major

_LAZY = {"TalkerLLM": ".llm", "FrameChannelError": ".llm", "FsmWorker": ".worker"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FrameChannelError", "FsmWorker", "RequestCodecError", "TakenFrames", "TalkerDirConfig", "TalkerLLM",
           "TokenMajorFrames", "decode_request", "encode_request", "to_token_major", "write_model_dir"]
