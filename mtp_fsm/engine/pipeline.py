"""The device pipeline of one step over its rows, in the lifecycle's phase order: current-step
(forward, sample, MTP, publish) or deferred (MTP of the pending frame, publish, forward, sample),
the model's entry points as it calls them (exceptions wrapped as ModelFault), and what differs
between talker families in a step's frame (FrameFormat: logit masks of a delay pattern, what the
MTP hook returns, the frame facts the publish stages read), chosen once per engine. The pipeline
has no per-family branches; a new family is a FrameFormat subclass plus its lifecycle spec."""

from __future__ import annotations

import torch

from ..errors import EngineInvariantError
from ..kernels.contract import OUT_CODES, OUT_ERROR, OUT_NUM_COMPUTED, OUT_REASON, OUT_STATE, StepBatch
from ..kernels.row_ops import owned_rows
from ..lifecycle import Predicate
from ..model_api import ColumnSpec, FrameDraws, ModelSpec, MtpResult, TalkerModel
from ..sampling.delay_pattern import DelayRows, banned_ids
from ..sampling.faults import FAULT_PAYLOAD, fault_word
from ..sampling.gaussian import gaussian_noise
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


class ModelFault(Exception):
    """A model call raised inside a step (wraps the model's own exception)."""


def frame_embed_of_words(frame_embed, spec):
    """frame_embed over the engine's frame rows: a model with a payload gets the payload
    decoded from the row's words (its codes are the engine's bookkeeping)."""
    if spec.payload is None:
        return frame_embed
    first, payload = spec.num_codebooks, spec.payload

    def embed(words: torch.Tensor) -> torch.Tensor:
        return frame_embed(payload.decode(words[:, first:]))

    return embed


def model_call(model: TalkerModel, name: str):
    """A model entry point whose exceptions become ModelFault, so step() can end that step's
    requests while a kernel bug still surfaces as itself. The method is looked up at each
    call (profilers and tests may wrap the model's methods after the engine is built)."""

    def call(*args, **kwargs):
        try:
            return getattr(model, name)(*args, **kwargs)
        except Exception as exc:
            raise ModelFault(exc) from exc

    call.__name__ = name
    return call


class DevicePipeline:
    """Runs stages 2-5 of a step (compose, forward, CB0 sampling, MTP, publication) with the
    engine's kernels and the model's entry points, and returns the packed output. What the
    talker family changes in a frame is its FrameFormat's (below).

    It holds the engine's parts, never the engine (a cycle would keep a dropped engine, and
    its claim on the model, alive until the garbage collector runs)."""

    def __init__(self, spec: ModelSpec, lifecycle, kernels, table, device_lifecycle, calls, allowed, device,
                 speculative=None) -> None:
        self.spec, self.lifecycle = spec, lifecycle
        self.kernels, self.table, self._lc = kernels, table, device_lifecycle
        self._forward, self._cb0_logits, mtp, self._frame_embed, self._text_step = calls
        self._allowed, self.device = allowed, device
        self.format = frame_format(spec, lifecycle, kernels, table, device_lifecycle, mtp, device)
        self.speculative = speculative  # a SpeculativeStep (lifecycle with a verify loop), else None
        self._width = OUT_CODES + spec.frame_width
        self._error_row = torch.zeros(1, self._width, dtype=torch.int64, device=device)
        self._error_row[0, OUT_ERROR] = 1
        # The lifecycle's phase order, chosen once: no per-step branch on the variant.
        self._rows = speculative.run if speculative is not None else (
            self._deferred if lifecycle.deferred else self._current_step)

    @property
    def positions(self) -> int:
        """Packed output rows per step row: 1, or the verify positions of a speculative step."""
        return 1 if self.speculative is None else self.speculative.positions

    def run(self, batch: StepBatch) -> torch.Tensor:
        width = self._width
        if batch.num_tokens == 0:  # nothing scheduled (or only padding): a no-op step
            packed = torch.zeros(batch.num_rows * self.positions, width, dtype=torch.int64, device=self.device)
        else:
            packed = self._rows(batch)
        # A trailing row carries the table-wide sticky error, so a bad slot no row scheduled
        # this step still surfaces in the same copy (int64 one-hot x int32 bits promotes to int64).
        sticky = self._error_row * self.table.error[: self.table.max_slots].amax()
        return torch.cat([packed, sticky])

    def _backbone(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Compose, forward and sample CB0 (the sample-phase stages): (last hidden, cb0)."""
        k, table, lc = self.kernels, self.table, self._lc
        inputs, positions, token_slots = k.compose_inputs(table, lc, batch, self._text_step)
        hidden = self._forward(inputs, positions, token_slots)
        last_hidden = hidden if batch.tokens_are_rows else hidden[batch.last_token]
        logits = self.format.cb0_logits(self._cb0_logits(last_hidden))
        cb0 = k.sample_cb0(table, lc, batch, logits, eos_token_id=self.spec.eos_token_id, allowed=self._allowed)
        return last_hidden, cb0

    def _publish(self, batch: StepBatch, codes: torch.Tensor) -> torch.Tensor:
        """The publish-phase stages, with the frame facts this model's lifecycle reads."""
        return self.kernels.publish_frames(self.table, self._lc, batch, codes, self._frame_embed(codes),
                                           **self.format.publish_facts)

    def _current_step(self, batch: StepBatch) -> torch.Tensor:
        self.format.begin(batch)
        hidden, cb0 = self._backbone(batch)
        codes = self.format.frame(batch, hidden, cb0)
        return self._publish(batch, codes)

    def _deferred(self, batch: StepBatch) -> torch.Tensor:
        """The pending frame (sampled last step) first, from the cached hidden state and CB0;
        rows with no pending frame compute an ignored one (their state fires no MTP edge)."""
        self.format.begin(batch)
        table, slot = self.table, batch.idx_mapping
        cached_hidden, cached_cb0 = table.extra[DEFERRED_HIDDEN][slot], table.extra[DEFERRED_CB0][slot]
        codes = self.format.frame(batch, cached_hidden, cached_cb0)
        packed = self._publish(batch, codes)
        hidden, cb0 = self._backbone(batch)
        # Only rows that own their slot write its cache (a stale row is flagged by the kernels and
        # must not clobber the owner's); rows that did not sample leave values no edge reads.
        owned = owned_rows(table, batch)
        cache_h, cache_cb0 = table.extra[DEFERRED_HIDDEN], table.extra[DEFERRED_CB0]
        cache_h[slot] = torch.where(owned[:, None], hidden.to(cache_h.dtype), cached_hidden)
        cache_cb0[slot] = torch.where(owned, cb0, cached_cb0)
        # The rows' state and reason after the whole step (publication ran before sampling).
        packed[:, OUT_STATE] = table.state[slot].to(packed.dtype)
        packed[:, OUT_REASON] = table.finish_reason[slot].to(packed.dtype)
        packed[:, OUT_NUM_COMPUTED] = table.num_computed[slot].to(packed.dtype)
        return packed


class FrameFormat:
    """Codes: CB0 alone (no MTP hook), or the MTP hook's [B, Q] codes (an MtpResult under a
    lifecycle whose MTP stage decides the stop)."""

    def __init__(self, spec: ModelSpec, lifecycle, kernels, table, device_lifecycle, mtp, device) -> None:
        self.spec, self.lifecycle = spec, lifecycle
        self.kernels, self.table, self._lc, self._mtp, self.device = kernels, table, device_lifecycle, mtp, device
        self.reads_mtp_stop = Predicate.MTP_STOP in lifecycle.predicates_read()
        eos_frame = spec.eos_token_id if Predicate.EOS_FRAME in lifecycle.predicates_read() else None
        # Frame facts the publish-phase stages read (keyword arguments of publish_frames).
        self.publish_facts = {"eoc": None, "eos": eos_frame}

    def begin(self, batch) -> None:
        """Per-step setup from the rows' slot columns, before anything of the step runs."""

    def cb0_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def sampler(self, sample):
        """The CodebookSampler the MTP hook gets."""
        return sample

    def frame(self, batch, hidden: torch.Tensor, cb0: torch.Tensor) -> torch.Tensor:
        """The MTP hook and the MTP-phase stages: the frame's rows [B, frame_width]."""
        if self._mtp is None:
            return cb0[:, None]
        sample, fault_words = self.kernels.mtp_sampler(self.table, batch)
        codes = self._mtp(hidden, cb0.clamp(0, self.spec.codebook_size - 1), self.sampler(sample))
        mtp_faults = fault_words()
        stop = None
        if isinstance(codes, MtpResult):
            if not self.reads_mtp_stop:
                raise EngineInvariantError(
                    f"model {self.spec.name!r} returned an MtpResult (an MTP-decided stop) but lifecycle "
                    f"{self.lifecycle.name!r} has no edge reading mtp_stop: use variant 'mtp_stop'")
            codes, stop = codes.codes, codes.stop
        self.kernels.mtp_scatter(self.table, self._lc, batch, mtp_faults, stop)
        return codes


class DelayPatternFormat(FrameFormat):
    """Higgs Audio's delay pattern: each codebook's logits masked (forced BOC / EOC, banned
    fillers) from the row's next frame index and last published frame, before it is sampled."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.pattern = self.spec.delay_pattern
        self._banned = banned_ids(self.pattern, self.device)
        self._rows: DelayRows | None = None
        self.publish_facts = {**self.publish_facts, "eoc": self.pattern.eoc}

    def begin(self, batch) -> None:
        table = self.table
        self._rows = DelayRows.for_rows(self.pattern, table.num_frames, table.frame_codes, table.frame_log,
                                        batch.idx_mapping, self._banned)

    def cb0_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self._rows.apply(logits, 0)

    def sampler(self, sample):
        rows = self._rows

        def sample_delayed(logits: torch.Tensor, codebook: int, params=None) -> torch.Tensor:
            masked = rows.apply(logits, codebook)
            return sample(masked, codebook) if params is None else sample(masked, codebook, params)
        return sample_delayed


class PayloadFormat(FrameFormat):
    """A continuous payload (VoxCPM2's patch): the MTP hook gets counter-based Gaussian noise and
    the row's previous payload, and returns the payload; the frame row is CB0 then the
    payload's bits. A non-finite payload faults the row like a bad MTP sample."""

    def frame(self, batch, hidden: torch.Tensor, cb0: torch.Tensor) -> torch.Tensor:
        sample, fault_words = self.kernels.mtp_sampler(self.table, batch)
        table, slot, payload, first = self.table, batch.idx_mapping, self.spec.payload, self.spec.num_codebooks
        keys = frame_key(table.seed[slot], table.num_frames[slot])
        previous = payload.decode(table.frame_codes[slot, first:])
        draws = FrameDraws(sample, lambda shape: gaussian_noise(keys, shape), previous)
        out = self._mtp(hidden, cb0.clamp(0, self.spec.codebook_size - 1), draws)
        bad = ~torch.isfinite(out.reshape(out.shape[0], -1)).all(dim=1)
        word = fault_word(FAULT_PAYLOAD, first)
        mtp_faults = fault_words()
        mtp_faults = torch.where(bad & (mtp_faults == 0), word, mtp_faults)
        self.kernels.mtp_scatter(self.table, self._lc, batch, mtp_faults, None)
        return torch.cat([cb0[:, None].to(torch.int64), payload.encode(out)], dim=1)


def frame_format(spec: ModelSpec, *args) -> FrameFormat:
    """The talker family's FrameFormat (args: lifecycle, kernels, table, device lifecycle, the
    MTP hook or None, device)."""
    if spec.payload is not None:
        return PayloadFormat(spec, *args)
    if spec.delay_pattern is not None:
        return DelayPatternFormat(spec, *args)
    return FrameFormat(spec, *args)
