"""The rows a step hands the device: persistent host and device buffers, one upload per changed batch."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from ..kernels.contract import StepBatch
from ..model_api import ModelSpec
from ..sampling.params import sampler_facts
from .admission import resolved

# The int64 row vectors of a StepBatch, in buffer order: per row (R), per row + 1, per token (T).
_PER_ROW = ("idx_mapping", "is_padding", "expected_serial", "num_scheduled", "last_token")
_PER_TOKEN = ("token_rows", "token_offsets")


@attrs.frozen
class LoadedRows:
    """What the buffers hold: a step's rows as the device stages and the host bookkeeping see them."""

    rows: tuple  # the plan's rows (Span | None), as planned
    generation: int  # the ledger's generation they were loaded in
    records: list  # RequestRecord | None per row
    batch: StepBatch  # device views of the buffers
    slots_np: np.ndarray  # int64 [R], slot per row (the scratch row for padding)
    tokens_np: np.ndarray  # int64 [R], tokens per row (0 for padding)
    padding_np: np.ndarray  # bool [R], a padding row (no tokens)
    all_real: bool  # no padding row: the host's per-step bookkeeping needs no mask
    query_start_loc: torch.Tensor  # host view (clone it to publish)
    row_ids: tuple
    row_ids_np: np.ndarray  # the row ids as an object array (the output's request ids)
    steady: bool  # every real row decodes or overruns: reusable as loaded while nothing changes


class StepInputs:
    """The one owner of the rows a step hands the device. The host buffer is one int64 tensor
    (pinned on CUDA) whose prefix holds this step's vectors back to back; the device buffer
    is its twin, filled by a single copy; the StepBatch's tensors are views of it. Both grow
    (doubling) when a step needs more rows or tokens than they hold.

    A plan whose rows equal the loaded ones in the same ledger generation (no admission,
    release, abort, preemption, resume or failed step since) and that were all decode or
    overrun rows is the steady decode batch: `holds()` says so and `load` returns the
    loaded rows untouched (no write, no upload, the same StepBatch object, which the decode
    graphs recognise), so the caller asks `holds` before it loads."""

    def __init__(self, scratch_slot: int, spec: ModelSpec, device: torch.device, decode_width: int = 1) -> None:
        self.scratch, self.spec, self.device, self.decode_width = scratch_slot, spec, device, decode_width
        self._host = self._device_buf = None
        self._uploaded: torch.cuda.Event | None = None  # the last upload out of the host buffer (CUDA)
        self._reserve(64)
        self.loaded: LoadedRows | None = None

    def _reserve(self, words: int) -> None:
        have = 0 if self._host is None else self._host.numel()
        if words <= have:
            return
        size = max(words, 2 * have)
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        # A twin even on the CPU: the batch never aliases what the next load writes, and the
        # CPU runs the copy a GPU makes (the bench's counters see one upload per new batch).
        self._device_buf = torch.zeros(size, dtype=torch.int64, device=self.device)

    def holds(self, rows: tuple, generation: int) -> LoadedRows | None:
        """The loaded rows when `rows` are the steady batch they were loaded from, else None."""
        loaded = self.loaded
        if loaded is not None and loaded.steady and loaded.generation == generation and loaded.rows == rows:
            return loaded
        return None

    def load(self, rows: tuple, records: list, generation: int, steady: bool) -> LoadedRows:
        """Write the rows into the buffers and upload them once. `records`: the RequestRecord
        per row (None for padding), its slot attached; `steady`: validation found every real
        row decoding or overrunning and the plan without host events."""
        counts = np.fromiter((0 if s is None else s.num_tokens for s in rows), np.int64, len(rows))
        slots = np.fromiter((self.scratch if r is None else r.slot for r in records), np.int64, len(rows))
        serials = np.fromiter((0 if r is None else r.serial for r in records), np.int64, len(rows))
        r, t = len(rows), int(counts.sum())
        words = len(_PER_ROW) * r + (r + 1) + len(_PER_TOKEN) * t
        self._reserve(words)
        if self._uploaded is not None:  # the host buffer may still be feeding the last upload
            self._uploaded.synchronize()
        host = self._host.numpy()
        views, at = {}, 0
        for name, n in (*((n, r) for n in _PER_ROW), ("query_start_loc", r + 1), *((n, t) for n in _PER_TOKEN)):
            views[name] = (at, n)
            at += n

        def put(name: str, values: np.ndarray) -> None:
            start, n = views[name]
            host[start:start + n] = values

        qsl = np.zeros(r + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        token_rows = np.repeat(np.arange(r, dtype=np.int64), counts)
        put("idx_mapping", slots)
        put("is_padding", [s is None for s in rows])
        put("expected_serial", serials)
        put("num_scheduled", counts)
        put("last_token", np.maximum(qsl[1:] - 1, 0))
        put("query_start_loc", qsl)
        put("token_rows", token_rows)
        put("token_offsets", np.arange(t, dtype=np.int64) - qsl[token_rows])
        dev = self._device_buf
        dev[:words].copy_(self._host[:words], non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        tensors = {name: dev[start:start + n] for name, (start, n) in views.items()}
        tensors["is_padding"] = tensors["is_padding"].bool()
        start, n = views["query_start_loc"]
        loaded = LoadedRows(
            rows, generation, records, self._batch(tensors, records, counts), slots, counts, counts == 0,
            bool(counts.all()),
            self._host[start:start + n], tuple(None if s is None else s.request_id for s in rows),
            np.array([None if s is None else s.request_id for s in rows], dtype=object), steady,
        )
        self.loaded = loaded
        return loaded

    def _batch(self, tensors: dict, records: list, counts: np.ndarray) -> StepBatch:
        spec = self.spec
        live = [resolved(spec, r) for r in records if r is not None]
        # Host-known sampler facts (no device read): the largest top_k and whether any row uses top-p.
        cb0_k_max, cb0_top_p, cb0_k_min = sampler_facts(cb0 for cb0, _ in live)
        mtp_k_max, mtp_top_p, mtp_k_min = sampler_facts(mtp for _, mtp in live)
        return StepBatch(
            **tensors,
            cb0_filters=cb0_k_max > 0 or cb0_top_p, mtp_filters=mtp_k_max > 0 or mtp_top_p,
            cb0_top_k_max=cb0_k_max, cb0_any_top_p=cb0_top_p, mtp_top_k_max=mtp_k_max, mtp_any_top_p=mtp_top_p,
            cb0_top_k_min=cb0_k_min, mtp_top_k_min=mtp_k_min,
            cb0_penalty=any(cb0.penalises for cb0, _ in live),
            cb0_min_frames=any(r.min_frames > 0 for r in records if r is not None),
            decode_width=self.decode_width,
            has_prefill=any(r is not None and r.in_prefill for r in records),
            tokens_are_rows=bool((counts == 1).all()),
        )
