"""The engine's batched sampler (`mtp_fsm.sampling.sample_tokens`) as every bench design calls it.

The floor and the two naive designs sample exactly like the engine's reference kernels
(`kernels/reference.py`: `sample_cb0`, `mtp_sampler`): the same function, the same
host-known shortcuts (filters on/off, the largest top_k, whether any row uses top-p), one
frame key per step shared by the frame's codebooks, and the MTP noise of all codebooks in
one pass when the block is small. Tokens are therefore bit-identical across designs, and
what the designs differ in is only how they get the per-row inputs (seed, frame index,
parameters) to the sampler: lifecycle bookkeeping.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from ..kernels.reference import BATCHED_NOISE_ELEMENTS
from ..sampling import SamplingParams, frame_key, gumbel_noise_codebooks, sample_tokens
from ..sampling.params import sampler_facts


@attrs.frozen
class ParamColumns:
    """One sampling side (CB0 or MTP) of a step's rows as the sampler takes it."""

    temperature: torch.Tensor  # float32 [B]
    top_k: torch.Tensor  # int64 [B]
    top_p: torch.Tensor  # float32 [B]
    filters: bool  # any row restricts top-k / top-p
    top_k_max: int
    any_top_p: bool
    top_k_min: int  # smallest top_k among rows that sample (NO_SAMPLED_ROWS: all greedy)

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> "ParamColumns":
        """Columns from per-row parameters (host lists -> tensors: the per-step staging cost
        a design without persistent columns pays)."""
        k_max, any_p, k_min = sampler_facts(params)
        return cls(
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            k_max > 0 or any_p, k_max, any_p, k_min,
        )

    def constant(self, params: SamplingParams) -> "ParamColumns":
        """The same rows with one set of parameters the model owns (e.g. MOSS's stop head)."""
        return ParamColumns(
            torch.full_like(self.temperature, params.temperature), torch.full_like(self.top_k, params.top_k),
            torch.full_like(self.top_p, params.top_p), params.filters, *sampler_facts([params]),
        )


class StepSampler:
    """One step's sampling for B rows: CB0 (codebook 0, `allowed` ids only) and the MTP
    codebooks, each a call of `sample_tokens` over all rows."""

    def __init__(self, seed: torch.Tensor, frame_index: torch.Tensor, cb0: ParamColumns, mtp: ParamColumns,
                 *, num_codebooks: int, allowed: torch.Tensor | None) -> None:
        self.seed, self.frame_index, self.cb0_params, self.mtp_params = seed, frame_index, cb0, mtp
        self.num_codebooks, self.allowed = num_codebooks, allowed
        self._key: torch.Tensor | None = None
        self._noise: dict[int, torch.Tensor | None] = {}

    @property
    def key(self) -> torch.Tensor:
        if self._key is None:
            self._key = frame_key(self.seed, self.frame_index)  # shared by the frame's codebooks
        return self._key

    def cb0(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens int64 [B], fault int32 [B]) of codebook 0."""
        p = self.cb0_params
        return sample_tokens(
            logits, p.temperature, p.top_k, p.top_p, self.seed, self.frame_index, 0,
            allowed=self.allowed, apply_filters=p.filters, top_k_max=p.top_k_max, any_top_p=p.any_top_p,
            top_k_min=p.top_k_min,
        )

    def _noise_for(self, codebook: int, vocab: int) -> torch.Tensor | None:
        count = self.num_codebooks - 1
        if not 1 <= codebook <= count:
            return None
        if vocab not in self._noise:
            fits = count * self.seed.shape[0] * vocab <= BATCHED_NOISE_ELEMENTS
            self._noise[vocab] = gumbel_noise_codebooks(self.key, 1, count, vocab) if fits else None
        block = self._noise[vocab]
        return None if block is None else block[codebook - 1]

    def mtp(self, logits: torch.Tensor, codebook: int, params: SamplingParams | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, fault) of one MTP codebook; params: a draw whose parameters the model owns."""
        p = self.mtp_params if params is None else self.mtp_params.constant(params)
        return sample_tokens(logits, p.temperature, p.top_k, p.top_p, self.seed, self.frame_index, codebook,
                             apply_filters=p.filters, key=self.key, top_k_max=p.top_k_max, any_top_p=p.any_top_p,
                             top_k_min=p.top_k_min, noise=self._noise_for(codebook, logits.shape[-1]))


def cb0_allowed(spec, device: torch.device | str = "cpu") -> torch.Tensor:
    """The engine's CB0 mask: codec ids and EOS may be sampled, other specials never."""
    allowed = torch.zeros(spec.backbone_vocab_size, dtype=torch.bool)
    allowed[: spec.codebook_size] = True
    if spec.eos_token_id is not None:
        allowed[spec.eos_token_id] = True
    return allowed.to(device)
