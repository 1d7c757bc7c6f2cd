"""The device pipeline of one step over its rows, in the lifecycle's phase order: current-step
(forward, sample, MTP, publish) or deferred (MTP of the pending frame, publish, forward, sample)."""

from __future__ import annotations

import torch

from ..errors import EngineInvariantError
from ..kernels.contract import OUT_CODES, OUT_ERROR, OUT_NUM_COMPUTED, OUT_REASON, OUT_STATE, StepBatch
from ..lifecycle import Predicate
from ..model_api import ColumnSpec, FrameDraws, ModelSpec, MtpResult
from ..sampling.faults import FAULT_PAYLOAD, fault_word
from ..sampling.gaussian import gaussian_noise
from ..sampling.delay_pattern import DelayRows, banned_ids
from ..sampling.noise import frame_key

# Engine-owned slot columns of the deferred schedule: what the sampling step leaves for the
# next step's MTP (reset with the row at admission, so a recycled slot starts from zeros).
DEFERRED_HIDDEN = "deferred_hidden"
DEFERRED_CB0 = "deferred_cb0"


def deferred_columns(spec: ModelSpec, lifecycle) -> dict[str, ColumnSpec]:
    if not lifecycle.deferred:
        return {}
    width = spec.forward_width or spec.hidden_size
    return {DEFERRED_HIDDEN: ColumnSpec((width,), spec.dtype), DEFERRED_CB0: ColumnSpec((), torch.int64)}


class DevicePipeline:
    """Runs stages 2-5 of a step (compose, forward, CB0 sampling, MTP, publication) with the
    engine's kernels and the model's entry points, and returns the packed output.

    It holds the engine's parts, never the engine (a cycle would keep a dropped engine, and
    its claim on the model, alive until the garbage collector runs)."""

    def __init__(self, spec: ModelSpec, lifecycle, kernels, table, device_lifecycle, calls, allowed, device,
                 speculative=None) -> None:
        self.spec, self.lifecycle = spec, lifecycle
        self.kernels, self.table, self._lc = kernels, table, device_lifecycle
        self._forward, self._cb0_logits, self._mtp, self._frame_embed, self._text_step = calls
        self._allowed, self.device = allowed, device
        self.reads_mtp_stop = Predicate.MTP_STOP in self.lifecycle.predicates_read()
        self._pattern = spec.delay_pattern
        self._banned = None if spec.delay_pattern is None else banned_ids(spec.delay_pattern, device)
        self._eoc = None if spec.delay_pattern is None else spec.delay_pattern.eoc
        self._eos_frame = spec.eos_token_id if Predicate.EOS_FRAME in lifecycle.predicates_read() else None
        self._delay: DelayRows | None = None  # this step's constraints (delay-pattern models)
        self.speculative = speculative  # a SpeculativeStep (lifecycle with a verify loop), else None

    @property
    def positions(self) -> int:
        """Packed output rows per step row: 1, or the verify positions of a speculative step."""
        return 1 if self.speculative is None else self.speculative.positions

    def run(self, batch: StepBatch) -> torch.Tensor:
        width = OUT_CODES + self.spec.frame_width
        if batch.num_tokens == 0:  # nothing scheduled (or only padding): a no-op step
            packed = torch.zeros(batch.num_rows * self.positions, width, dtype=torch.int64, device=self.device)
        elif self.speculative is not None:
            packed = self.speculative.run(batch)
        elif self.lifecycle.deferred:
            packed = self._deferred(batch)
        else:
            packed = self._current_step(batch)
        # A trailing row carries the table-wide sticky error, so a bad slot no row scheduled
        # this step still surfaces in the same copy.
        global_row = torch.zeros(1, width, dtype=torch.int64, device=self.device)
        global_row[0, OUT_ERROR] = self.table.error[: self.table.max_slots].amax()
        return torch.cat([packed, global_row])

    def _backbone(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Compose, forward and sample CB0 (the sample-phase stages): (last hidden, cb0)."""
        k, table, lc = self.kernels, self.table, self._lc
        inputs, positions, token_slots = k.compose_inputs(table, lc, batch, self._text_step)
        hidden = self._forward(inputs, positions, token_slots)
        last_hidden = hidden[batch.last_token]
        logits = self._cb0_logits(last_hidden)
        if self._pattern is not None:
            self._delay = DelayRows.for_rows(self._pattern, table.num_frames, table.frame_codes, batch.idx_mapping,
                                             self._banned)
            logits = self._delay.apply(logits, 0)
        cb0 = k.sample_cb0(table, lc, batch, logits, eos_token_id=self.spec.eos_token_id, allowed=self._allowed)
        return last_hidden, cb0

    def _frame(self, batch: StepBatch, hidden: torch.Tensor, cb0: torch.Tensor) -> torch.Tensor:
        """The MTP hook and the MTP-phase stages: the frame's codes [B, Q]."""
        if self._mtp is None:
            return cb0[:, None]
        sample, mtp_faults = self.kernels.mtp_sampler(self.table, batch)
        if self._delay is not None:
            sample = self._delayed(sample, self._delay)
        if self.spec.payload is not None:
            return self._payload_frame(batch, hidden, cb0, sample, mtp_faults)
        codes = self._mtp(hidden, cb0.clamp(0, self.spec.codebook_size - 1), sample)
        stop = None
        if isinstance(codes, MtpResult):
            if not self.reads_mtp_stop:
                raise EngineInvariantError(
                    f"model {self.spec.name!r} returned an MtpResult (an MTP-decided stop) but lifecycle "
                    f"{self.lifecycle.name!r} has no edge reading mtp_stop: use variant 'mtp_stop'")
            codes, stop = codes.codes, codes.stop
        self.kernels.mtp_scatter(self.table, self._lc, batch, mtp_faults, stop)
        return codes

    def _payload_frame(self, batch: StepBatch, hidden: torch.Tensor, cb0: torch.Tensor, sample,
                       mtp_faults: torch.Tensor) -> torch.Tensor:
        """A model with a payload: its MTP hook returns the payload (from per-row Gaussian
        noise and the row's previous payload); the frame row is CB0 then the payload's bits.
        A non-finite payload faults the row like a bad MTP sample."""
        table, slot, payload, first = self.table, batch.idx_mapping, self.spec.payload, self.spec.num_codebooks
        keys = frame_key(table.seed[slot], table.num_frames[slot])
        previous = payload.decode(table.frame_codes[slot, first:])
        draws = FrameDraws(sample, lambda shape: gaussian_noise(keys, shape), previous)
        out = self._mtp(hidden, cb0.clamp(0, self.spec.codebook_size - 1), draws)
        bad = ~torch.isfinite(out.reshape(out.shape[0], -1)).all(dim=1)
        word = fault_word(FAULT_PAYLOAD, first)
        mtp_faults.copy_(torch.where(bad & (mtp_faults == 0), word, mtp_faults))
        self.kernels.mtp_scatter(self.table, self._lc, batch, mtp_faults, None)
        return torch.cat([cb0[:, None].to(torch.int64), payload.encode(out)], dim=1)

    def _publish(self, batch: StepBatch, codes: torch.Tensor) -> torch.Tensor:
        """The publish-phase stages, with the frame facts this model's lifecycle reads."""
        return self.kernels.publish_frames(self.table, self._lc, batch, codes, self._frame_embed(codes),
                                           self._eoc, self._eos_frame)

    @staticmethod
    def _delayed(sample, rows: DelayRows):
        """The MTP sampler with the delay pattern's constraints on each codebook's logits."""
        def sample_delayed(logits: torch.Tensor, codebook: int, params=None) -> torch.Tensor:
            masked = rows.apply(logits, codebook)
            return sample(masked, codebook) if params is None else sample(masked, codebook, params)
        return sample_delayed

    def _current_step(self, batch: StepBatch) -> torch.Tensor:
        hidden, cb0 = self._backbone(batch)
        codes = self._frame(batch, hidden, cb0)
        return self._publish(batch, codes)

    def _deferred(self, batch: StepBatch) -> torch.Tensor:
        """The pending frame (sampled last step) first, from the cached hidden state and CB0;
        rows with no pending frame compute an ignored one (their state fires no MTP edge)."""
        table, slot = self.table, batch.idx_mapping
        cached_hidden, cached_cb0 = table.extra[DEFERRED_HIDDEN][slot], table.extra[DEFERRED_CB0][slot]
        codes = self._frame(batch, cached_hidden, cached_cb0)
        packed = self._publish(batch, codes)
        hidden, cb0 = self._backbone(batch)
        # Only rows that own their slot write its cache (a stale row is flagged by the kernels and
        # must not clobber the owner's); rows that did not sample leave values no edge reads.
        owned = ~batch.is_padding & (table.serial[slot] == batch.expected_serial)
        cache_h, cache_cb0 = table.extra[DEFERRED_HIDDEN], table.extra[DEFERRED_CB0]
        cache_h[slot] = torch.where(owned[:, None], hidden.to(cache_h.dtype), cached_hidden)
        cache_cb0[slot] = torch.where(owned, cb0, cached_cb0)
        # The rows' state and reason after the whole step (publication ran before sampling).
        packed[:, OUT_STATE] = table.state[slot].to(packed.dtype)
        packed[:, OUT_REASON] = table.finish_reason[slot].to(packed.dtype)
        packed[:, OUT_NUM_COMPUTED] = table.num_computed[slot].to(packed.dtype)
        return packed
