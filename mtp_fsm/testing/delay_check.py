"""The delay pattern checked on a request's published frames, restated in MusicGen's terms."""

from __future__ import annotations

from ..lifecycle import FinishReason
from ..model_api import DelayPattern


def delay_pattern_problems(frames, pattern: DelayPattern, reason: FinishReason | None = None) -> list[str]:
    """What is wrong with `frames` (sequences of Q ints, in order) under `pattern`: codebook q
    runs q frames behind codebook 0, so it holds BOC before frame q, and, when codebook 0
    first holds EOC at frame e, EOC from frame e + q + 1 on (codebook 0 from e; upstream's
    wind-down, in which the last frame keeps codebook Q-1's code); elsewhere no filler (EOC
    only on codebook 0, at e). A request ending with reason eos ends with the frame
    e + Q - 1; nothing follows that frame."""
    problems: list[str] = []
    eoc_at = next((f for f, codes in enumerate(frames) if codes[0] == pattern.eoc), None)
    for f, codes in enumerate(frames):
        for q, code in enumerate(codes):
            if q > f:
                want = pattern.boc
            elif eoc_at is not None and (f > eoc_at + q or (q == 0 and f == eoc_at)):
                want = pattern.eoc
            else:
                want = None
            if want is not None and code != want:
                problems.append(f"frame {f} codebook {q} is {code}, the pattern forces {want}")
            if want is None and (code == pattern.boc or (code == pattern.eoc and (q > 0 or f != eoc_at))):
                problems.append(f"frame {f} codebook {q} holds the filler {code} outside the pattern")
    if eoc_at is not None and len(frames) > eoc_at + len(frames[0]):
        problems.append(f"{len(frames)} frames: the wind-down from frame {eoc_at} ended at {eoc_at + len(frames[0]) - 1}")
    if reason is FinishReason.EOS and (eoc_at is None or len(frames) != eoc_at + len(frames[0])):
        problems.append(f"ended eos after {len(frames)} frames, not at the end of a wind-down (EOC at {eoc_at})")
    if reason not in (None, FinishReason.EOS) and eoc_at is not None and len(frames) == eoc_at + len(frames[0]):
        problems.append(f"the wind-down completed but the request ended {reason.label}")
    return problems
