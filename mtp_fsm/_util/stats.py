"""The one percentile (and median) used for every latency / step-time summary in mtp_fsm."""

from __future__ import annotations

from typing import Iterable


def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile (0 <= p <= 100) of `values`, linearly interpolated between the
    closest ranks (numpy's default method; p=50 is the median). Raises ValueError when empty."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    pos = p / 100 * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
