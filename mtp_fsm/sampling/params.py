"""Per-request sampling parameters and their validation at admission."""

from __future__ import annotations

import math

import attrs


# The largest count a request may carry (top_k, max_frames): it must fit the slot table's
# integer columns and every index computed from it.
MAX_COUNT = 2**31 - 1


@attrs.frozen
class SamplingParams:
    """Temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0

    def problems(self) -> list[str]:
        out = []
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            out.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if type(self.top_k) is not int or not 0 <= self.top_k <= MAX_COUNT:  # a bool is not a count
            out.append(f"top_k must be an int in [0, {MAX_COUNT}] (0 disables), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            out.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        return out

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p actually restrict the distribution (needs a sort)."""
        return self.top_k > 0 or self.top_p < 1.0


GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
