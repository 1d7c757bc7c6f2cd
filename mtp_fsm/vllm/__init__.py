"""Adapters to vLLM's shapes (token-major outputs)."""

from .token_major import TokenMajorFrames, to_token_major

__all__ = ["TokenMajorFrames", "to_token_major"]
