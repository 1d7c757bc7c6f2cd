"""Engine-owned static decode steps: persistent padded step buffers per batch bucket, replayed
as CUDA graphs on a GPU (or run eagerly over the same buffers)."""

from __future__ import annotations

from typing import Callable

import warnings

import torch

from ..errors import KernelBackendError
from ..kernels.contract import StepBatch

MODES = ("auto", "off", "eager", "cuda")
# Padded batch sizes a decode step is rounded up to (a graph per bucket and sampler facts).
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def resolve_mode(mode: str, device: torch.device, kernels, decode_width: int) -> str:
    """"auto": CUDA graphs where they can run (a CUDA device, Triton kernels) for one token
    per decode row, else off; a speculative engine's verify rows (decode_width = k + 1)
    take buckets when asked ("eager" or "cuda"), since their capture has not been checked
    on a GPU yet. "eager": the padded buffers without capture (what a graph replays,
    runnable anywhere: the CPU check of this path). "cuda" refuses what cannot be captured."""
    if mode not in MODES:
        raise KernelBackendError(f"unknown decode_graphs mode {mode!r}; choose one of {MODES}")
    capturable = device.type == "cuda" and getattr(kernels, "CUDA_GRAPHS", False)
    if mode == "auto":
        return "cuda" if capturable and decode_width == 1 else "off"
    if mode == "cuda" and not capturable:
        raise KernelBackendError(
            f"decode_graphs='cuda' needs a CUDA device and the Triton kernels (device {device}, kernels "
            f"{kernels.__name__}): "
            "the torch reference stages read host values on purpose (candidate sampling) and cannot be captured")
    return mode


# StepBatch's host-known values (sampler shortcuts) a captured step bakes in: part of its key.
HOST_FACTS = ("cb0_filters", "mtp_filters", "cb0_top_k_max", "cb0_any_top_p", "mtp_top_k_max", "mtp_any_top_p",
              "cb0_top_k_min", "mtp_top_k_min", "cb0_penalty", "cb0_min_frames")


def host_facts(batch: StepBatch) -> tuple:
    return tuple(getattr(batch, name) for name in HOST_FACTS)


class BucketStep:
    """One bucket's persistent StepBatch (row i <-> tokens i * W .. i * W + W - 1, W the decode
    width: 1, or k + 1 for a speculative engine's verify rows; padding rows point at the
    scratch row, W inert tokens each), and on CUDA the captured graph of the device stages
    over it."""

    def __init__(self, bucket: int, scratch: int, like: StepBatch, device: torch.device,
                 run: Callable[[StepBatch], torch.Tensor]) -> None:
        self.bucket, self.scratch, self._run = bucket, scratch, run
        width = self.width = like.decode_width
        arange = torch.arange(bucket, dtype=torch.int64, device=device)
        facts = dict(zip(HOST_FACTS, host_facts(like)))
        self.batch = StepBatch(
            idx_mapping=torch.full((bucket,), scratch, dtype=torch.int64, device=device),
            is_padding=torch.ones(bucket, dtype=torch.bool, device=device),
            expected_serial=torch.zeros(bucket, dtype=torch.int64, device=device),
            num_scheduled=torch.zeros(bucket, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(bucket + 1, dtype=torch.int64, device=device) * width,
            token_rows=arange.repeat_interleave(width),
            token_offsets=torch.arange(width, dtype=torch.int64, device=device).repeat(bucket),
            last_token=arange * width + width - 1,
            **{**facts, "has_prefill": False, "decode_width": width, "tokens_are_rows": width == 1},
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None  # the captured step's packed output (static)
        self._loaded: StepBatch | None = None  # the batch whose rows the buffers hold
        self._rows = 0

    def load(self, batch: StepBatch) -> None:
        """The batch's rows into the buffers (nothing to copy when it is the batch loaded last:
        the engine reuses one StepBatch for an unchanged steady batch)."""
        if batch is self._loaded:
            return
        n, b = batch.num_rows, self.batch
        for dst, src in ((b.idx_mapping, batch.idx_mapping), (b.is_padding, batch.is_padding),
                         (b.expected_serial, batch.expected_serial), (b.num_scheduled, batch.num_scheduled),
                         (b.scheduled, batch.scheduled), (b.owner_serial, batch.owner_serial)):
            dst[:n].copy_(src)
        if n < self._rows:  # rows that held the last batch's requests are padding again
            b.idx_mapping[n:self._rows].fill_(self.scratch)
            b.is_padding[n:self._rows].fill_(True)
            b.expected_serial[n:self._rows].fill_(0)
            b.num_scheduled[n:self._rows].fill_(0)
            b.scheduled[n:self._rows].fill_(False)
            b.owner_serial[n:self._rows].fill_(-1)
        self._loaded, self._rows = batch, n

    def capture(self) -> None:
        """Warm up (first-call compilation, lazy tables) and capture while every row is padding:
        inert, so warm-up and capture change nothing a request owns."""
        self.load_padding()
        stream = torch.cuda.Stream(self.batch.idx_mapping.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(self.batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self._run(self.batch)
        self.graph = graph

    def load_padding(self) -> None:
        b = self.batch
        b.idx_mapping.fill_(self.scratch)
        b.is_padding.fill_(True)
        b.expected_serial.zero_()
        b.num_scheduled.zero_()
        b.scheduled.fill_(False)
        b.owner_serial.fill_(-1)
        self._loaded, self._rows = None, 0

    def run(self, rows: int) -> torch.Tensor:
        """The step over the loaded rows: packed output of the real rows (per_row packed rows
        each: 1, or a speculative step's verify positions) + the global row."""
        if self.graph is not None:
            self.graph.replay()
            out = self.out
        else:
            out = self._run(self.batch)
        per_row = (out.shape[0] - 1) // self.bucket
        return out if rows == self.bucket else torch.cat([out[:rows * per_row], out[-1:]])


class DecodeGraphs:
    """Routes the engine's decode-only steps through padded buckets: the smallest bucket that
    holds the rows, one BucketStep per (bucket, host facts), captured on first use in mode
    "cuda". Steps with admissions, events, prefill rows or more rows than the largest bucket
    run the engine's eager stages as before."""

    def __init__(self, mode: str, buckets, scratch: int, device: torch.device,
                 run: Callable[[StepBatch], torch.Tensor], *, strict: bool,
                 variant: Callable[[], int] | None = None) -> None:
        self.mode, self.buckets = mode, tuple(sorted(set(buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise KernelBackendError(f"decode graph buckets must be positive sizes, got {buckets!r}")
        self.scratch, self.device, self._run, self.strict = scratch, device, run, strict
        # What else a captured step bakes in: a speculative step's proposal count.
        self._variant = variant
        self.steps: dict[tuple, BucketStep] = {}
        self.replays = 0  # decode steps that ran through a bucket
        self.refused: dict[tuple, str] = {}  # bucket keys whose capture failed (they run eagerly)

    def eligible(self, host) -> bool:
        batch = host.batch
        return (host.events is None and host.admits is None and not batch.has_prefill
                and batch.num_tokens == batch.num_rows * batch.decode_width and 0 < batch.num_rows <= self.buckets[-1])

    def key(self, batch: StepBatch) -> tuple:
        """(bucket, host facts, decode width, variant): which BucketStep a batch runs on (built,
        captured, on first use). A speculative engine's width (1 + the drafts verified) and
        proposal count may change from step to step: each pair has its buckets."""
        variant = None if self._variant is None else self._variant()
        return next(b for b in self.buckets if b >= batch.num_rows), host_facts(batch), batch.decode_width, variant

    def run(self, batch: StepBatch) -> torch.Tensor:
        key = self.key(batch)
        step = self.steps.get(key)
        if step is None:
            step = BucketStep(key[0], self.scratch, batch, self.device, self._run)
            if self.mode == "cuda":
                self._capture(key, step)
            self.steps[key] = step
        step.load(batch)
        self.replays += 1
        return step.run(batch.num_rows)

    def _capture(self, key: tuple, step: BucketStep) -> None:
        try:
            step.capture()
        except Exception as exc:  # e.g. a model hook that reads a device value on the host
            torch.cuda.synchronize(self.device)
            step.graph, step.out = None, None
            step.load_padding()
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if self.strict:
                raise KernelBackendError(f"decode step of bucket {key[0]} could not be captured: {why}") from exc
            self.refused[key] = why
            warnings.warn(f"mtp_fsm: decode bucket {key[0]} runs eagerly, its capture failed: {why}", stacklevel=3)
