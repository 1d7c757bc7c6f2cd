"""Host staging of admissions: the values admitted rows start from and the frames resumed rows replay."""

from __future__ import annotations

import torch

from ..kernels.contract import ReplayFrames, StagedAdmits
from ..model_api import ModelSpec
from ..slots import SlotTable
from .admission import resolved
from .records import RequestRecord


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
