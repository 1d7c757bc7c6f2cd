"""The delay pattern's per-codebook constraints (forced BOC / EOC, banned fillers) as logit masks."""

from __future__ import annotations

import torch

from ..model_api import DelayPattern


class DelayRows:
    """One step's delay-pattern constraints for its rows, built from each row's next frame
    index and last published frame (engine slot columns), applied to a codebook's logits
    before it is sampled, so the sampler, its noise and its fault checks stay unchanged.

    forced [B, Q]: the id codebook q must take (-1: free). A forced codebook keeps only its
    id's logit (a non-finite logit there still faults, loudly); a free one may not take BOC,
    nor EOC unless it is codebook 0."""

    def __init__(self, pattern: DelayPattern, frame_index: torch.Tensor, last_codes: torch.Tensor) -> None:
        self.pattern = pattern
        q = torch.arange(last_codes.shape[1], device=last_codes.device)[None, :]
        is_eoc = last_codes == pattern.eoc
        # EOC codes of the last frame when its codebook 0 is EOC (0 outside the wind-down);
        # a row that published nothing yet has no last frame.
        depth = torch.where(is_eoc[:, 0] & (frame_index > 0), is_eoc.sum(dim=1), 0)[:, None]
        boc = torch.where(q > frame_index[:, None], pattern.boc, -1)
        self.forced = torch.where((depth > 0) & (q <= depth), pattern.eoc, boc)

    @classmethod
    def for_rows(cls, pattern: DelayPattern, num_frames: torch.Tensor, frame_codes: torch.Tensor,
                 slots: torch.Tensor) -> "DelayRows":
        return cls(pattern, num_frames[slots], frame_codes[slots])

    def apply(self, logits: torch.Tensor, codebook: int) -> torch.Tensor:
        ids = torch.arange(logits.shape[-1], device=logits.device)[None, :]
        forced = self.forced[:, codebook: codebook + 1]
        banned = (ids == self.pattern.boc) | ((ids == self.pattern.eoc) & (codebook > 0))
        keep = torch.where(forced >= 0, ids == forced, ~banned)
        return logits.masked_fill(~keep, float("-inf"))
