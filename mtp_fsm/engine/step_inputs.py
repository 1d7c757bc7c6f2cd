"""Everything a step hands the device: its rows (persistent buffers, one upload), host events, admissions."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from ..kernels.contract import ReplayFrames, StagedAdmits, StagedEvents, StepBatch
from ..model_api import ModelSpec
from ..slots import SlotTable
from ..sampling.params import sampler_facts
from .admission import resolved
from .records import RequestRecord

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
            rows, generation, records, self._batch(tensors, records, counts), slots, counts,
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


# -- host events and admissions: staged per step that has them ----------------------------


def stage_events(slots: list[int], triggers: list[list[int]], reasons: list[int], device: torch.device) -> StagedEvents:
    """Host events (up to two triggers per slot, -1 = none; the finish reason to record) for the device."""
    return StagedEvents(upload(torch.tensor(slots, dtype=torch.int64), device),
                        upload(torch.tensor(triggers, dtype=torch.int64), device),
                        upload(torch.tensor(reasons, dtype=torch.int32), device))


def _home(tensors, device: torch.device) -> torch.device:
    """Where to assemble tensors bound for `device`: there when any of them already is (a
    model that prepares on the device, frames captured from the slot table), so nothing goes
    device -> host -> device; else on the host, for one upload."""
    return device if any(t is not None and t.device == device for t in tensors) else torch.device("cpu")


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor to a CUDA device through pinned memory (an async copy: no host sync)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def stage_admits(table: SlotTable, spec: ModelSpec, admitted: list[RequestRecord], trigger: int):
    """Values every admitted row is initialised with, and the frames resumed rows replay."""
    if not admitted:
        return None, None
    device = table.device
    longest = max(r.base_prompt_len for r in admitted)
    home = _home([r.prepared.prompt_embeds for r in admitted], device)
    prompts = torch.zeros(len(admitted), longest, spec.hidden_size, dtype=spec.dtype, device=home)
    for i, r in enumerate(admitted):
        prompts[i, : r.prepared.prompt_embeds.shape[0]] = r.prepared.prompt_embeds.to(home)
    req = [r.request for r in admitted]
    cb0, mtp = zip(*(resolved(spec, r) for r in admitted))
    values = {
        "serial": [r.serial for r in admitted], "prompt_len": [r.prompt_len for r in admitted],
        "num_frames": [r.num_frames for r in admitted], "max_frames": [q.max_frames for q in req],
        "seed": [q.seed for q in req],
        "cb0_temperature": [p.temperature for p in cb0], "cb0_top_k": [p.top_k for p in cb0],
        "cb0_top_p": [p.top_p for p in cb0], "cb0_penalty": [p.repetition_penalty for p in cb0],
        "min_frames": [r.min_frames for r in admitted],
        "mtp_temperature": [p.temperature for p in mtp], "mtp_top_k": [p.top_k for p in mtp],
        "mtp_top_p": [p.top_p for p in mtp],
    }
    columns = table.columns()
    staged = {k: upload(torch.tensor(v, dtype=columns[k].dtype), device) for k, v in values.items()}
    staged["prompt_embeds"] = upload(prompts, device)
    for name in table.extra:
        given = [r.column_value(name) for r in admitted]
        if all(g is None for g in given):
            continue
        tail = tuple(max(dims) for dims in zip(*(g.shape for g in given if g is not None)))
        # Padding beyond a shorter value (and rows that give none) holds the declared fill.
        home = _home(given, device)
        stacked = torch.full((len(admitted), *tail), table.extra_fill[name], dtype=columns[name].dtype, device=home)
        for i, g in enumerate(given):
            if g is not None:
                stacked[i][tuple(slice(0, n) for n in g.shape)] = g.to(home)
        staged[name] = upload(stacked, device)
    slots = upload(torch.tensor([r.slot for r in admitted], dtype=torch.int64), device)
    replays = [(r, r.replay_codes) for r in admitted if r.replay_codes is not None and len(r.replay_codes)]
    replay = None
    if replays:
        home = _home([c for _, c in replays], device)  # the codes were captured from the slot table
        log = torch.zeros(len(admitted), max(len(c) for _, c in replays), spec.frame_width, dtype=torch.int64,
                          device=home)
        for i, r in enumerate(admitted):
            if r.replay_codes is not None:
                log[i, : len(r.replay_codes)] = r.replay_codes.to(home)
        staged["frame_log"] = upload(log, device)
        # The last published frame (what a delay pattern's wind-down and a payload's `previous`
        # continue from): row i's log at its frame count - 1 (zeros for a row with none).
        frames = upload(torch.tensor([0 if r.replay_codes is None else len(r.replay_codes) for r in admitted]), home)
        last = log[torch.arange(len(admitted), device=home), (frames - 1).clamp(min=0)]
        staged["frame_codes"] = upload(torch.where((frames > 0)[:, None], last, 0), device)
        # The repetition penalty's CB0 counts, rebuilt exactly from the replayed frames (a
        # scatter-add: bincount would read its output size back from the device).
        counts = torch.zeros(len(admitted), table.cb0_counts.shape[1], dtype=table.cb0_counts.dtype, device=home)
        for i, r in enumerate(admitted):
            if r.replay_codes is not None and len(r.replay_codes):
                cb0 = r.replay_codes[:, 0].to(home).clamp(0, counts.shape[1] - 1)
                counts[i].scatter_add_(0, cb0, torch.ones_like(cb0, dtype=counts.dtype))
        staged["cb0_counts"] = upload(counts, device)
        replay = ReplayFrames(
            slots=upload(torch.cat([torch.full((len(c),), r.slot, dtype=torch.int64) for r, c in replays]), device),
            frame_index=upload(torch.cat([torch.arange(len(c)) for _, c in replays]), device),
            positions=upload(torch.cat([torch.arange(len(c)) + r.base_prompt_len for r, c in replays]), device),
            codes=upload(torch.cat([c.to(home) for _, c in replays]), device),
        )
        for r, _ in replays:
            r.replay_codes = None
    return StagedAdmits(slots, staged, trigger), replay
