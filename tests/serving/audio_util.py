"""Test helpers for the audio stage: a rule-based fake decoder, and streaming codes through an AudioStream."""

from __future__ import annotations

import math
import threading

import torch

from mtp_fsm.engine import FinishedRequest, FrameBatch
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.serving.audio_stream import AudioStream, PcmChunk


class RuleDecoder:
    """A decoder whose sample p is a known function of frames [q - receptive, q + lookahead],
    q = (p + tail) // spf: the shape of a real one (left receptive field, lookahead, a
    trimmed tail like Qwen3-Omni's 555 samples), computable by hand. Frames outside a
    window count as zero, so a window without enough context gives wrong samples."""

    def __init__(self, spf: int = 4, tail: int = 0, receptive: int = 2, lookahead: int = 0, max_batch: int = 8,
                 sample_rate: int = 16_000, delay_s: float = 0.0, fail_on: int | None = None) -> None:
        self.sample_rate, self.samples_per_frame, self.max_batch = sample_rate, spf, max_batch
        self.tail, self.receptive, self.lookahead_frames = tail, receptive, lookahead
        self.left_context_frames = receptive + lookahead + math.ceil(tail / spf)
        self.delay_s, self.fail_on = delay_s, fail_on
        self.calls: list[tuple[int, int, bool]] = []  # (batch, window, final)
        self.gate = threading.Event()  # cleared: decode blocks (a worker busy for as long as a test wants)
        self.gate.set()
        self.entered = threading.Event()  # set once a decode call began

    def decode(self, frames: torch.Tensor, final: bool) -> torch.Tensor:
        self.entered.set()
        self.gate.wait()
        if self.delay_s:
            threading.Event().wait(self.delay_s)
        b, w, _ = frames.shape
        self.calls.append((b, w, final))
        if self.fail_on is not None and bool((frames[..., 0] == self.fail_on).any()):
            raise ValueError(f"code {self.fail_on} is poison")
        spf = self.samples_per_frame
        value = (frames.to(torch.float64) * torch.arange(1, frames.shape[-1] + 1)).sum(-1) % 1009  # [B, W]
        n = w * spf if final else max(0, (w - self.lookahead_frames) * spf - self.tail)
        p = torch.arange(n)
        q = (p + self.tail) // spf
        out = torch.zeros(b, n, dtype=torch.float64)
        for k in range(-self.receptive, self.lookahead_frames + 1):
            j = q + k
            inside = (j >= 0) & (j < w)
            out += torch.where(inside, value[:, j.clamp(0, w - 1)], 0.0) * (k + 3) / 1e4
        return (out + (p % spf) / 1e3).to(torch.float32)


def stream_codes(decoder, requests: dict[str, torch.Tensor], *, first_chunk=None, chunk=3, threaded=False,
                 frames_per_step: int = 1, finish: dict[str, FinishReason] | None = None,
                 abort_after: dict[str, int] | None = None) -> tuple[dict[str, list[PcmChunk]], AudioStream]:
    """Feed each request's frames [N, F] round-robin, `frames_per_step` per request per step, finishing
    each when its frames are out (or aborting it after `abort_after[rid]` frames); -> PCM chunks by request."""
    out: dict[str, list[PcmChunk]] = {}
    width = next(iter(requests.values())).shape[1]
    stream = AudioStream(decoder, lambda c: out.setdefault(c.request_id, []).append(c), frame_width=width,
                         first_chunk=first_chunk, chunk=chunk, threaded=threaded)
    finish, abort_after = finish or {}, abort_after or {}
    cursor = {rid: 0 for rid in requests}
    step = 0
    while cursor:
        rids, index, rows = [], [], []
        for rid in list(cursor):
            stop = min(len(requests[rid]), abort_after.get(rid, len(requests[rid])))
            for _ in range(frames_per_step):
                if cursor[rid] < stop:
                    rids.append(rid), index.append(cursor[rid]), rows.append(requests[rid][cursor[rid]])
                    cursor[rid] += 1
        if rids:
            stream.on_frames(step, FrameBatch(tuple(rids), torch.tensor(index), torch.stack(rows)))
        for rid in list(cursor):
            if rid in abort_after and cursor[rid] >= abort_after[rid]:
                stream.on_finished(step, FinishedRequest(rid, FinishReason.ABORT, cursor[rid]))
                del cursor[rid]
            elif cursor[rid] >= len(requests[rid]):
                stream.on_finished(step, FinishedRequest(rid, finish.get(rid, FinishReason.EOS), cursor[rid]))
                del cursor[rid]
        step += 1
    stream.close()
    return out, stream


def joined(chunks: list[PcmChunk]) -> torch.Tensor:
    """The chunks' samples in order, checking they tile the stream (no gap, no overlap)."""
    position = 0
    for i, c in enumerate(chunks):
        assert c.index == i and c.start_sample == position, (c.index, c.start_sample, position)
        position += len(c.samples)
    assert chunks and chunks[-1].is_final and not any(c.is_final for c in chunks[:-1])
    return torch.cat([c.samples for c in chunks]) if chunks else torch.zeros(0)


def whole(decoder, frames: torch.Tensor) -> torch.Tensor:
    """One whole-sequence decode of a request's frames."""
    with torch.inference_mode():
        return decoder.decode(frames.unsqueeze(0), True)[0]
