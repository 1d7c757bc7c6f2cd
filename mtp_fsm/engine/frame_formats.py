"""What differs between talker families in a step's frame, chosen once per engine: logit masks
(a delay pattern), what the MTP hook returns (codes, codes with an MTP-decided stop, a
continuous payload) and the frame facts the publish stages read. The pipeline has no
per-family branches; a new family is a FrameFormat subclass plus its lifecycle spec."""

from __future__ import annotations

import torch

from ..errors import EngineInvariantError
from ..lifecycle import Predicate
from ..model_api import FrameDraws, ModelSpec, MtpResult
from ..sampling.delay_pattern import DelayRows, banned_ids
from ..sampling.faults import FAULT_PAYLOAD, fault_word
from ..sampling.gaussian import gaussian_noise
from ..sampling.noise import frame_key


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
