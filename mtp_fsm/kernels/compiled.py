"""The torch reference stages with their lifecycle work compiled by TorchInductor (kernels="compiled")."""

from __future__ import annotations

import torch

from ..lifecycle import DeviceLifecycle
from ..slots import SlotTable
from . import reference
from .contract import StepBatch, TextStep
# Admission, events and replay run rarely; the MTP sampler is float work whose results must
# stay bit-identical to the reference: these stay eager.
from .reference import apply_admits, apply_host_events, mtp_sampler, replay_frames  # noqa: F401
# Speculative verify positions: eager (their draw is the sampler's float work).
from .verify import sample_positions, verify_frames  # noqa: F401

# Only integer bookkeeping and copies are compiled (the lifecycle phases, the table writes,
# the composed inputs): fused code computes them bit for bit like the eager ops. The sampler,
# model calls and the models' own text step stay eager. fullgraph: a graph break is a bug
# here, not a silent fallback. dynamic=None: a stage compiles static for its first batch
# size and generalises over batch sizes at its second, instead of once per size.
# A stage reaches a blocked column (SlotTable.lifecycle_words / progress) through its block,
# never its view attribute: a view of a graph input has no guard source once the slot count
# goes dynamic (a second table size), and the guard fails to build.
_compose_rows = torch.compile(reference.compose_rows, fullgraph=True)
_record_cb0 = torch.compile(reference.record_cb0, fullgraph=True)
mtp_scatter = torch.compile(reference.mtp_scatter, fullgraph=True)
publish_frames = torch.compile(reference.publish_frames, fullgraph=True)


def compose_inputs(table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, text_step: TextStep):
    return _compose_rows(table, lc, batch, reference.decode_text(table, batch, text_step))


def sample_cb0(table: SlotTable, lc: DeviceLifecycle, batch: StepBatch, logits: torch.Tensor, *,
               eos_token_id: int | None, allowed: torch.Tensor | None) -> torch.Tensor:
    tokens, fault = reference.draw_cb0(table, batch, logits, eos_token_id=eos_token_id, allowed=allowed)
    _record_cb0(table, lc, batch, tokens, fault, eos_token_id)
    return tokens
