"""Per-request sampling parameters and their validation at admission."""

from __future__ import annotations

import math

import attrs


# The largest count a request may carry (top_k, max_frames): it must fit the slot table's
# integer columns and every index computed from it.
MAX_COUNT = 2**31 - 1
# sampler_facts' smallest top_k when no row samples (every row greedy): no noise is drawn.
NO_SAMPLED_ROWS = 1 << 62


@attrs.frozen
class SamplingParams:
    """Temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters.

    repetition_penalty (CB0 only, HF semantics): every id the request already published as
    a CB0 code has its logit divided by the penalty when positive, multiplied when negative,
    before temperature and filters; 1.0 disables, None takes the model's default
    (ModelSpec.repetition_penalty; Qwen3-TTS: 1.05, like the official generate).
    """

    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float | None = None

    def problems(self) -> list[str]:
        out = []
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            out.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if type(self.top_k) is not int or not 0 <= self.top_k <= MAX_COUNT:  # a bool is not a count
            out.append(f"top_k must be an int in [0, {MAX_COUNT}] (0 disables), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            out.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        penalty = self.repetition_penalty
        if penalty is not None and (isinstance(penalty, bool) or not isinstance(penalty, (int, float))
                                    or not math.isfinite(penalty) or penalty <= 0):
            out.append(f"repetition_penalty must be a finite number > 0 (1.0 disables) or None, got {penalty!r}")
        return out

    def with_penalty(self, default: float) -> "SamplingParams":
        """These parameters with repetition_penalty resolved (None -> the model's default)."""
        if self.repetition_penalty is not None:
            return self
        return attrs.evolve(self, repetition_penalty=float(default))

    @property
    def penalises(self) -> bool:
        """Whether the (resolved) repetition penalty changes any logit."""
        return self.repetition_penalty is not None and self.repetition_penalty != 1.0

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p actually restrict the distribution (needs a sort)."""
        return self.top_k > 0 or self.top_p < 1.0


GREEDY = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)


def sampler_facts(params) -> tuple[int, bool, int]:
    """Host-known facts of a batch's rows for `sample_tokens` (no device read): the largest
    top_k, whether any row uses top-p, and the smallest top_k among the rows that sample
    (temperature > 0; NO_SAMPLED_ROWS when every row is greedy)."""
    k_max, any_top_p, k_min = 0, False, NO_SAMPLED_ROWS
    for p in params:
        k_max, any_top_p = max(k_max, p.top_k), any_top_p or p.top_p < 1.0
        if p.temperature > 0:
            k_min = min(k_min, p.top_k)
    return k_max, any_top_p, k_min
