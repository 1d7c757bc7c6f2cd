"""Host staging of a step's device inputs: admitted rows' values, replayed frames, rows."""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.contract import ReplayFrames, StagedAdmits, StepBatch
from ..model_api import ModelSpec
from ..sampling import SamplingParams
from ..sampling.params import sampler_facts
from ..slots import SlotTable
from .records import RequestRecord


def sampling_of(spec: ModelSpec, request) -> tuple[SamplingParams, SamplingParams]:
    """(CB0, MTP) sampling a request runs with: the model's own where it fixes them
    (spec.cb0_sampling / mtp_sampling, e.g. MOSS's audio sampling), else the request's; the
    CB0 repetition penalty resolved (None -> the model's default)."""
    cb0 = (spec.cb0_sampling or request.cb0_sampling).with_penalty(spec.repetition_penalty)
    return cb0, spec.mtp_sampling or request.mtp_sampling


def min_frames_of(spec: ModelSpec, request) -> int:
    """Frames a request publishes before CB0 EOS may be sampled (None -> the model's default)."""
    return spec.min_frames if request.min_frames is None else request.min_frames


def resolved(spec: ModelSpec, record: RequestRecord) -> tuple[SamplingParams, SamplingParams]:
    """The record's (CB0, MTP) sampling, resolved once per request (with its min_frames)."""
    if record.sampling is None:
        record.sampling = sampling_of(spec, record.request)
        record.min_frames = min_frames_of(spec, record.request)
    return record.sampling


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


class RowBatches:
    """build_batch, keeping the last batch: a step whose rows, owners (slot, serial) and
    token counts equal the previous step's, the steady decode batch, reuses its device
    tensors and sampler facts (a request's parameters never change) instead of rebuilding
    them: no tensor construction and no host-to-device copy for an unchanged batch."""

    def __init__(self, table: SlotTable, spec: ModelSpec, decode_width: int = 1) -> None:
        self.table, self.spec, self.decode_width = table, spec, decode_width
        self._key: tuple | None = None
        self._built: tuple[StepBatch, np.ndarray, torch.Tensor] | None = None

    def build(self, records: list[RequestRecord | None], counts: list[int]):
        """(StepBatch, slot per row as numpy, query_start_loc on the host)."""
        key = (tuple(None if r is None else (r.slot, r.serial) for r in records), tuple(counts))
        if key != self._key or self._built is None:
            self._built = build_batch(self.table, self.spec, records, counts, self.decode_width)
            self._key = key
        return self._built


def _to_device(host: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Host int64 vectors as device views of one buffer: one host-to-device copy (from pinned
    memory, so it does not block) instead of one per vector. Elsewhere each vector is moved
    as it is (on the CPU a no-op, which the bench's copy counter reads as the upload a GPU makes)."""
    if device.type != "cuda":
        return {name: t.to(device) for name, t in host.items()}
    names = list(host)
    flat = torch.cat([host[n] for n in names]).pin_memory()
    moved = flat.to(device, non_blocking=True)
    return dict(zip(names, torch.split(moved, [host[n].numel() for n in names])))


def build_batch(
    table: SlotTable, spec: ModelSpec, records: list[RequestRecord | None], counts: list[int], decode_width: int = 1,
) -> tuple[StepBatch, np.ndarray, torch.Tensor]:
    """The StepBatch for rows in order (None = padding, mapped to the scratch row), the
    slot per row (numpy) and query_start_loc on the host."""
    scratch = table.max_slots
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    device = table.device
    idx = [scratch if r is None else r.slot for r in records]
    token_rows = torch.repeat_interleave(torch.arange(len(records)), torch.tensor(counts, dtype=torch.int64))
    qsl = torch.tensor(starts, dtype=torch.int64)
    live = [resolved(spec, r) for r in records if r is not None]
    # Host-known sampler facts (no device read): the largest top_k and whether any row uses top-p.
    cb0_k_max, cb0_top_p, cb0_k_min = sampler_facts(cb0 for cb0, _ in live)
    cb0_penalty = any(cb0.penalises for cb0, _ in live)
    min_frames = any(r.min_frames > 0 for r in records if r is not None)
    mtp_k_max, mtp_top_p, mtp_k_min = sampler_facts(mtp for _, mtp in live)
    rows = _to_device({
        "idx_mapping": torch.tensor(idx, dtype=torch.int64),
        "is_padding": torch.tensor([r is None for r in records], dtype=torch.int64),
        "expected_serial": torch.tensor([0 if r is None else r.serial for r in records], dtype=torch.int64),
        "num_scheduled": torch.tensor(counts, dtype=torch.int64),
        "query_start_loc": qsl,
        "token_rows": token_rows,
        "token_offsets": torch.arange(starts[-1]) - qsl[token_rows],
        "last_token": (qsl[1:] - 1).clamp(min=0),
    }, device)
    rows["is_padding"] = rows["is_padding"].bool()
    batch = StepBatch(
        **rows,
        cb0_filters=cb0_k_max > 0 or cb0_top_p,
        mtp_filters=mtp_k_max > 0 or mtp_top_p,
        cb0_top_k_max=cb0_k_max,
        cb0_any_top_p=cb0_top_p,
        mtp_top_k_max=mtp_k_max,
        mtp_any_top_p=mtp_top_p,
        cb0_top_k_min=cb0_k_min,
        mtp_top_k_min=mtp_k_min,
        cb0_penalty=cb0_penalty,
        cb0_min_frames=min_frames,
        decode_width=decode_width,
        has_prefill=any(r is not None and r.in_prefill for r in records),
        tokens_are_rows=all(n == 1 for n in counts),
    )
    return batch, np.array(idx, dtype=np.int64), qsl
