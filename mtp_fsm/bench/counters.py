"""Counts device ops and host syncs per step (TorchDispatchMode), split by engine stage."""

from __future__ import annotations

import collections
import os
import traceback
from typing import Callable, Sequence

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .instrument import GLUE, HOST_OUTPUT, HOST_STAGE, instrument_engine

# Ops whose result the host must read (a device->host sync on a GPU).
SYNC_OPS = frozenset({
    "item", "_local_scalar_dense", "is_nonzero", "nonzero", "equal", "allclose", "masked_select",
    "_unique", "_unique2", "unique_dim", "unique_consecutive",
})
# Ops that create a tensor from host (Python) data: a host->device copy on a GPU.
H2D_OPS = frozenset({"lift_fresh", "lift_fresh_copy"})
COPY_OPS = frozenset({"_to_copy", "to", "copy_"})
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@attrs.define
class StepCounts:
    """What one step dispatched, excluding host staging and output building (counted apart)."""

    ops: int = 0  # every aten op (views included)
    kernels: int = 0  # non-view ops: a proxy for kernel launches
    syncs: int = 0  # host reads of device values (item, nonzero, tolist, bool masks, ...)
    d2h: int = 0  # copies to the host (the step's output copy)
    h2d: int = 0  # tensors made from host data inside the step (H2D copies on a GPU)
    by_stage: dict[str, int] = attrs.field(factory=dict)  # kernels per stage label
    sites: list[str] = attrs.field(factory=list)  # where each sync / copy happened
    host_stage_ops: int = 0  # ops in Ledger.stage (staging tensors), for information
    host_output_ops: int = 0  # ops in _build_output, for information

    def key(self) -> tuple:
        """What must not depend on the batch size (view ops may: torch adds a `view` for
        some 1-row index_put_ calls)."""
        return (self.kernels, self.syncs, self.d2h, self.h2d, tuple(sorted(self.by_stage.items())))

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def _where() -> str:
    """The innermost mtp_fsm frame (outside the bench) that issued the current op."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PKG_ROOT) and os.sep + "bench" + os.sep not in path:
            return f"{os.path.relpath(path, os.path.dirname(_PKG_ROOT))}:{frame.lineno} {frame.name}"
    frame = traceback.extract_stack()[-4]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"


def _device_of(value) -> torch.device | None:
    if value is None:
        return None
    return torch.device(value) if isinstance(value, (str, torch.device)) else None


def _is_d2h(name: str, args, kwargs) -> bool:
    """A copy whose destination is the host (on a CPU run: an explicit .to('cpu') / .cpu())."""
    if name not in COPY_OPS:
        return False
    if name == "copy_":
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu"
    target = _device_of(kwargs.get("device"))
    if target is None:
        target = next((_device_of(a) for a in args[1:] if isinstance(a, (str, torch.device))), None)
    if target is None or target.type != "cpu":
        return False
    src = args[0]
    # On a CPU run an explicit copy to the host stands for the GPU's device-to-host copy;
    # a `.to("cpu")` of a host tensor without copy=True is a no-op alias (e.g. Tensor.numpy).
    return src.device.type != "cpu" or name == "_to_copy" or bool(kwargs.get("copy", False))


def _bool_index(name: str, args) -> bool:
    if name not in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))


class OpCounter(TorchDispatchMode):
    """Counts aten ops by stage label; syncs, D2H and H2D copies are located by source line."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.active = True
        self.trace: list[str] | None = None  # set to [] to record every op (debugging)
        self.reset()

    def reset(self) -> None:
        self.counts = StepCounts()
        self._stage = collections.Counter()

    def enter(self, label: str) -> None:
        self.stack.append(label)

    def leave(self, label: str) -> None:
        self.stack.pop()

    @property
    def label(self) -> str:
        return self.stack[-1] if self.stack else GLUE

    def record_sync(self, what: str) -> None:
        if self.active and not self._host():
            self.counts.syncs += 1
            self.counts.sites.append(f"sync {what} in {self.label} at {_where()}")

    def _host(self) -> bool:
        return HOST_STAGE in self.stack or HOST_OUTPUT in self.stack

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active:
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func, args, kwargs) -> None:
        c = self.counts
        if HOST_STAGE in self.stack:
            c.host_stage_ops += 1
            return
        if HOST_OUTPUT in self.stack:
            c.host_output_ops += 1
            return
        name = func._schema.name.split("::")[-1]
        c.ops += 1
        if self.trace is not None:
            self.trace.append(f"{self.label} {func}")
        # Copies first: `to` and `lift_fresh` are alias ("view") ops in their schemas.
        if _is_d2h(name, args, kwargs):
            c.d2h += 1
            c.sites.append(f"d2h aten.{name} in {self.label} at {_where()}")
        elif name in H2D_OPS:
            c.h2d += 1
            c.sites.append(f"h2d aten.{name} in {self.label} at {_where()}")
        if func.is_view:
            return
        c.kernels += 1
        self._stage[self.label] += 1
        c.by_stage = dict(self._stage)
        if name in SYNC_OPS or _bool_index(name, args):
            c.syncs += 1
            c.sites.append(f"sync aten.{name} in {self.label} at {_where()}")


class counting:
    """Context manager: an OpCounter plus a patched Tensor.tolist (not an aten op) counted as a sync."""

    def __init__(self) -> None:
        self.counter = OpCounter()

    def __enter__(self) -> OpCounter:
        counter, original = self.counter, torch.Tensor.tolist
        self._original = original

        def tolist(t, *a, **k):
            counter.record_sync("Tensor.tolist")
            return original(t, *a, **k)

        torch.Tensor.tolist = tolist
        counter.__enter__()
        return counter

    def __exit__(self, *exc) -> None:
        self.counter.__exit__(*exc)
        torch.Tensor.tolist = self._original


def count_engine_step(engine, plan) -> StepCounts:
    """Counts of one `engine.step(plan)`; Ledger.stage and _build_output are counted apart."""
    with counting() as counter:
        with instrument_engine(engine, counter.enter, counter.leave):
            engine.step(plan)
    return counter.counts


def count_call(fn: Callable[[], object]) -> StepCounts:
    """Counts of any callable (the naive drivers' step): every op is on the step's path."""
    with counting() as counter:
        fn()
    return counter.counts


def engine_counts_by_batch(
    model_factory: Callable[[], object], batch_sizes: Sequence[int], inputs: object
) -> dict[int, dict[str, StepCounts]]:
    """Per batch size: counts of the admit+prefill step and of a steady decode step.

    Every batch runs on an engine of the same size (the largest batch), so what varies
    is only the number of rows in the step: the engine's per-step work must not."""
    from ..engine import Span, StepPlan
    from .drivers import EngineDriver, make_requests

    from ..sampling.noise import gumbel_table

    out = {}
    max_slots = max(batch_sizes)
    for b in batch_sizes:
        gumbel_table(torch.device("cpu"))  # built lazily on first use: not part of any step
        driver = EngineDriver(model_factory(), make_requests(b, inputs), max_slots=max_slots)
        lengths = [int(driver.engine.model.prepare(r.inputs).prompt_embeds.shape[0]) for r in driver.requests]
        admit_plan = StepPlan(
            new_requests=tuple(r.to_new() for r in driver.requests),
            rows=tuple(Span(r.request_id, n) for r, n in zip(driver.requests, lengths)),
        )
        admit = count_engine_step(driver.engine, admit_plan)
        driver.step()  # the first decode step after prefill, then count a steady one
        decode = count_engine_step(driver.engine, driver._decode)
        out[b] = {"admit": admit, "decode": decode}
    return out


def constant_in_batch(counts: dict[int, dict[str, StepCounts]], phase: str = "decode") -> tuple[bool, list[str]]:
    """Whether `phase` counts are identical at every batch size; else what differs."""
    sizes = sorted(counts)
    base = counts[sizes[0]][phase]
    diffs = []
    for b in sizes[1:]:
        other = counts[b][phase]
        if other.key() != base.key():
            stages = set(base.by_stage) | set(other.by_stage)
            moved = {s: (base.by_stage.get(s, 0), other.by_stage.get(s, 0)) for s in sorted(stages)
                     if base.by_stage.get(s, 0) != other.by_stage.get(s, 0)}
            diffs.append(f"B={sizes[0]} vs B={b}: ops {base.ops}->{other.ops}, syncs {base.syncs}->{other.syncs}, "
                         f"stages {moved}")
    return not diffs, diffs
