"""The delay pattern's per-codebook constraints (forced BOC / EOC, banned fillers) as logit masks."""

from __future__ import annotations

import torch

from ..model_api import DelayPattern


def banned_ids(pattern: DelayPattern, device: torch.device) -> torch.Tensor:
    """The ids a free codebook may not take, [codebook 0, codebooks >= 1] (int64 [2, 2]): built
    once by a caller that steps (a tensor built per step is a host-to-device copy)."""
    return torch.tensor([[pattern.boc, pattern.boc], [pattern.boc, pattern.eoc]], device=device)


class DelayRows:
    """One step's delay-pattern constraints for its rows, built from each row's next frame
    index and its last two published frames (engine slot columns), applied to a codebook's
    logits before it is sampled, so the sampler, its noise and its fault checks stay unchanged.

    forced [B, Q]: the id codebook q must take (-1: free). A forced codebook keeps only its
    id's logit (a non-finite logit there still faults, loudly); a free one may not take BOC,
    nor EOC unless it is codebook 0.

    The wind-down follows upstream (boson-multimodal's `_sample_audio_tokens`): when codebook
    0 first samples EOC at frame e, frame e + j holds EOC on codebooks 0..j-1, so frame e + 1
    repeats frame e's single EOC and the last frame, e + Q - 1, keeps codebook Q-1's code.
    From the frames: the last one's EOC count m (0 unless its codebook 0 is EOC), plus one
    when the frame before it had EOC on codebook 0 already (that tells e + 1 from e + 2)."""

    def __init__(self, pattern: DelayPattern, frame_index: torch.Tensor, last_codes: torch.Tensor,
                 before_last: torch.Tensor | None = None, banned: torch.Tensor | None = None) -> None:
        self.pattern = pattern
        q = torch.arange(last_codes.shape[1], device=last_codes.device)[None, :]
        is_eoc = last_codes == pattern.eoc
        # A row that published nothing yet has no last frame, one frame no frame before it.
        last_count = torch.where(is_eoc[:, 0] & (frame_index > 0), is_eoc.sum(dim=1), 0)
        winding = torch.zeros_like(last_count, dtype=torch.bool) if before_last is None else (
            (before_last[:, 0] == pattern.eoc) & (frame_index > 1))
        locked = torch.where(last_count > 0, last_count + winding.long(), 0)[:, None]  # codebooks q < locked
        boc = torch.where(q > frame_index[:, None], pattern.boc, -1)
        self.forced = torch.where(q < locked, pattern.eoc, boc)
        self._is_forced = self.forced >= 0  # [B, Q]
        self._forced_id = self.forced.clamp(min=0)
        self._banned = banned_ids(pattern, q.device) if banned is None else banned

    @classmethod
    def for_rows(cls, pattern: DelayPattern, num_frames: torch.Tensor, frame_codes: torch.Tensor,
                 frame_log: torch.Tensor, slots: torch.Tensor, banned: torch.Tensor | None = None) -> "DelayRows":
        frame_index = num_frames[slots]
        before = (frame_index - 2).clamp(0, frame_log.shape[1] - 1)
        return cls(pattern, frame_index, frame_codes[slots], frame_log[slots, before], banned)

    def apply(self, logits: torch.Tensor, codebook: int) -> torch.Tensor:
        # Two passes over [B, V] (the copy, the forced rows' fill); the rest touches O(B) entries.
        forced, forced_id = self._is_forced[:, codebook: codebook + 1], self._forced_id[:, codebook: codebook + 1]
        kept = logits.gather(1, forced_id)  # the forced id's own logit (a NaN there still faults)
        out = logits.index_fill(1, self._banned[min(codebook, 1)], float("-inf"))
        free = out.gather(1, forced_id)  # what a free row holds there after the bans
        out.masked_fill_(forced, float("-inf"))
        return out.scatter_(1, forced_id, torch.where(forced, kept, free))
