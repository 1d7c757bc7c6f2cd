"""Counts what one whole step dispatches: ops, host<->device copies and host syncs.

Whole step means everything a design's `step()` runs, host staging and output building
included. The bench runs on a CPU, where host and device memory are the same, so the
counter tracks which tensors a CUDA run would hold on the host and which on the device:

- host-born: made from host data (`torch.tensor`, `from_numpy`, `as_tensor`), by a factory
  given no device (`torch.zeros(n)`, `torch.arange(n)`), by `.to("cpu")` / `.cpu()`, or by
  an op whose tensor inputs are all host-born;
- device-born: everything else, including every tensor that existed before tracking began
  (model weights, the engine's tables) and factories given a `torch.device` (the engine's).

The counter is switched on around a driver's construction and warm-up steps (tracking
only), so buffers a design keeps on the host across steps are known as host tensors.
Then, over a counted step:

- H2D: a host-born tensor sent to the device: `.to(<torch.device>)`, `copy_` into a device
  tensor, `torch.tensor(data, device=<torch.device>)`, or (what a CUDA run would reject
  unless copied) a host-born tensor of rank >= 1 used by an op on device tensors; once per
  tensor.
- D2H: device data read into host memory: `.to("cpu")`, `.cpu()`, `copy_` into a host
  tensor, `tolist()`, `item()` / `int()` / `bool()`, `numpy()`.
- syncs: host waits on the device: every D2H above, plus data-dependent ops on device
  tensors (`nonzero`, boolean-mask indexing, `masked_select`, `unique`, ...).
- ops: every non-view aten op, split into device ops (a launch on a GPU: any device-born
  tensor involved, or a device factory) and host ops (all tensors host-born: CPU work).

A literal `"cpu"` target (`.to("cpu")`) is read as "to the host" and a `torch.device`
target as "to the engine's device": the engine and the drivers are written that way.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import weakref
from typing import Callable, Iterator

import attrs
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .instrument import GLUE, instrument_engine

# Ops whose result the host must wait for (data-dependent output size or a host value).
SYNC_OPS = frozenset({
    "item", "_local_scalar_dense", "is_nonzero", "nonzero", "equal", "allclose", "masked_select",
    "_unique", "_unique2", "unique_dim", "unique_consecutive",
})
SCALAR_READS = frozenset({"item", "_local_scalar_dense", "is_nonzero"})  # also copy the value to the host
LIFT_OPS = frozenset({"lift_fresh", "lift_fresh_copy"})
# Factories that take `device=`: given none (or the literal "cpu"), they build on the host.
FACTORIES = ("zeros", "ones", "empty", "full", "arange", "linspace", "eye", "rand", "randn", "randint",
             "tensor", "as_tensor", "from_numpy", "empty_strided", "zeros_like", "ones_like", "empty_like",
             "full_like")
FROM_HOST_DATA = frozenset({"tensor", "as_tensor", "from_numpy"})
_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@attrs.define
class StepCounts:
    """What one whole step dispatched (see the module docstring for the definitions)."""

    ops: int = 0  # every aten op (views included)
    kernels: int = 0  # non-view ops
    device_ops: int = 0  # non-view ops a GPU would launch
    host_ops: int = 0  # non-view ops on host tensors only
    syncs: int = 0  # host waits on device results (every D2H included)
    d2h: int = 0  # device -> host copies
    h2d: int = 0  # host -> device copies
    by_stage: dict[str, int] = attrs.field(factory=dict)  # non-view ops per stage label
    sites: list[str] = attrs.field(factory=list)  # where each sync / copy happened

    def key(self) -> tuple:
        """What must not depend on the batch size (view ops may: torch adds a `view` for
        some 1-row index_put_ calls)."""
        return (self.kernels, self.device_ops, self.syncs, self.d2h, self.h2d, tuple(sorted(self.by_stage.items())))

    def to_dict(self) -> dict:
        return attrs.asdict(self)

    def summary(self) -> str:
        return (f"{self.kernels} ops ({self.device_ops} device, {self.host_ops} host), {self.h2d} H2D, "
                f"{self.d2h} D2H, {self.syncs} syncs")


def _where() -> str:
    """The innermost mtp_fsm frame (outside the bench) that issued the current op; else the
    innermost bench frame (the naive drivers and the floor live in the bench)."""
    fallback = None
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_PKG_ROOT) and not path.endswith(os.sep + "counters.py"):
            where = f"{os.path.relpath(path, os.path.dirname(_PKG_ROOT))}:{frame.f_lineno} {frame.f_code.co_name}"
            if os.sep + "bench" + os.sep not in path:
                return where
            fallback = fallback or where
        frame = frame.f_back
    return fallback or "?"


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _target(args, kwargs):
    """The device target of a `.to(...)` call: a str, a torch.device, a Tensor, or None."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    for a in args:
        if isinstance(a, (str, torch.device, torch.Tensor)):
            return a
    return None


class StepCounter(TorchDispatchMode):
    """Tracks host-born tensors while active; counts while `counting` (see `count`)."""

    def __init__(self) -> None:
        super().__init__()
        self._host: dict[int, tuple[weakref.ref, frozenset[int]]] = {}
        self._next_origin = 0
        self.counting = False
        self.stack: list[str] = []
        self._suspended = 0
        self._host_factory = 0
        self._in_to = 0
        self._moved: set[int] = set()
        self.base_label = "step"
        self.reset()

    # -- host / device bookkeeping -------------------------------------------------------

    def is_host(self, t: torch.Tensor) -> bool:
        entry = self._host.get(id(t))
        return entry is not None and entry[0]() is t

    def origins(self, t: torch.Tensor) -> frozenset[int]:
        """The host data a host-born tensor derives from (what a GPU run uploads once)."""
        entry = self._host.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else frozenset()

    def _mark(self, t: torch.Tensor, host: bool, origins: frozenset[int] | None = None) -> None:
        key = id(t)
        if host:
            if not origins:
                self._next_origin += 1
                origins = frozenset((self._next_origin,))

            def drop(ref, key=key, table=self._host):
                entry = table.get(key)
                if entry is not None and entry[0] is ref:
                    del table[key]
            try:
                self._host[key] = (weakref.ref(t, drop), origins)
            except TypeError:  # pragma: no cover - a tensor type without weakrefs
                pass
        else:
            self._host.pop(key, None)

    def _alias(self, t: torch.Tensor) -> torch.Tensor:
        """A new tensor object over t's storage (a CPU no-op `.to` returns t itself, but on a
        GPU the result is another tensor, living on the other side)."""
        self._suspended += 1
        try:
            return t.detach()
        finally:
            self._suspended -= 1

    # -- counting ------------------------------------------------------------------------

    def reset(self) -> None:
        self.counts = StepCounts()
        self._stage: collections.Counter[str] = collections.Counter()
        self._moved = set()

    def enter(self, label: str) -> None:
        self.stack.append(label)

    def leave(self, label: str) -> None:
        self.stack.pop()

    @property
    def label(self) -> str:
        return self.stack[-1] if self.stack else self.base_label

    def _site(self, what: str) -> None:
        self.counts.sites.append(f"{what} in {self.label} at {_where()}")

    def h2d(self, what: str) -> None:
        if self.counting:
            self.counts.h2d += 1
            self._site(f"h2d {what}")

    def d2h(self, what: str) -> None:
        """A device -> host copy the host then reads: one D2H and one sync."""
        if self.counting:
            self.counts.d2h += 1
            self.counts.syncs += 1
            self._site(f"d2h {what}")

    def sync(self, what: str) -> None:
        if self.counting:
            self.counts.syncs += 1
            self._site(f"sync {what}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._suspended:
            return out
        name = func._schema.name.split("::")[-1]
        inputs = _tensors((args, kwargs))
        host_in = [t for t in inputs if self.is_host(t)]
        on_device = len(host_in) < len(inputs)
        mutates = func._schema.is_mutable
        if not mutates:  # an in-place op's output is its input: it keeps its side
            host_out = name in LIFT_OPS or bool(self._host_factory) or (bool(inputs) and not on_device)
            origins = frozenset().union(*(self.origins(t) for t in host_in)) if host_out and host_in else None
            for t in _tensors(out):
                self._mark(t, host_out, origins)
        if self.counting:
            self._count(func, name, args, inputs, host_in, on_device)
        return out

    def _count(self, func, name, args, inputs, host_in, on_device) -> None:
        c = self.counts
        c.ops += 1
        if name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            dst_host, src_host = self.is_host(args[0]), self.is_host(args[1])
            if src_host and not dst_host:
                self._moved |= self.origins(args[1])
                self.h2d("aten.copy_")
            elif dst_host and not src_host:
                self.d2h("aten.copy_")
        elif on_device and not self._in_to:
            for t in host_in:  # host data a GPU op would need on the device: uploaded once
                fresh = self.origins(t) - self._moved
                if t.dim() > 0 and fresh:
                    self._moved |= fresh
                    self.h2d(f"host data {tuple(t.shape)} used by aten.{name}")
        if func.is_view:
            return
        c.kernels += 1
        device_op = on_device or (not inputs and not self._host_factory and name not in LIFT_OPS)
        if device_op:
            c.device_ops += 1
        else:
            c.host_ops += 1
        self._stage[self.label] += 1
        c.by_stage = dict(self._stage)
        if device_op and on_device and (name in SYNC_OPS or _bool_index(name, args)):
            if name in SCALAR_READS:
                self.d2h(f"aten.{name}")
            else:
                self.sync(f"aten.{name}")

    # -- Python-level entry points (not aten ops, or no-ops on a CPU) ---------------------

    @contextlib.contextmanager
    def _patched(self) -> Iterator[None]:
        # Dynamo takes the ids of torch's functions when it is first imported: imported while
        # torch's factories are replaced below, it would treat the real ones as unknown builtins
        # and the compiled engine design could not trace them. Imported here, not at module
        # import: it imports triton, which must not happen before a test session has chosen
        # the Triton interpreter (tests/kernels/conftest.py).
        import torch._dynamo.trace_rules  # noqa: F401

        counter = self
        T = torch.Tensor
        originals = {name: getattr(T, name) for name in ("to", "cpu", "cuda", "tolist", "numpy")}
        factories = {name: getattr(torch, name) for name in FACTORIES if hasattr(torch, name)}

        def moved(src: torch.Tensor, out: torch.Tensor, to_host: bool, what: str) -> torch.Tensor:
            src_host = counter.is_host(src)
            if to_host and not src_host:
                counter.d2h(what)
            elif not to_host and src_host:
                counter._moved |= counter.origins(src)
                counter.h2d(what)
            if out is src and src_host != to_host:
                out = counter._alias(src)
            counter._mark(out, to_host)
            return out

        def to(t, *args, **kwargs):
            target = _target(args, kwargs)
            counter._in_to += 1
            try:
                out = originals["to"](t, *args, **kwargs)
            finally:
                counter._in_to -= 1
            if target is None or counter._suspended:
                return out
            if isinstance(target, torch.Tensor):
                to_host = counter.is_host(target)
            else:
                to_host = isinstance(target, str) and target == "cpu"
            return moved(t, out, to_host, f"Tensor.to({target!r})" if not isinstance(target, torch.Tensor) else "Tensor.to(tensor)")

        def cpu(t, *args, **kwargs):
            out = originals["cpu"](t, *args, **kwargs)
            return out if counter._suspended else moved(t, out, True, "Tensor.cpu()")

        def cuda(t, *args, **kwargs):  # pragma: no cover - CUDA runs only
            out = originals["cuda"](t, *args, **kwargs)
            return out if counter._suspended else moved(t, out, False, "Tensor.cuda()")

        def tolist(t, *args, **kwargs):
            if not counter._suspended and not counter.is_host(t):
                counter.d2h("Tensor.tolist")
            return originals["tolist"](t, *args, **kwargs)

        def numpy(t, *args, **kwargs):
            if not counter._suspended and not counter.is_host(t):
                counter.d2h("Tensor.numpy")
            return originals["numpy"](t, *args, **kwargs)

        def factory(name, fn):
            def wrapper(*args, **kwargs):
                device = kwargs.get("device")
                data_tensor = name in ("as_tensor",) and args and isinstance(args[0], torch.Tensor)
                if data_tensor or name.endswith("_like") and device is None:
                    return fn(*args, **kwargs)  # follows its input
                to_host = device is None or (isinstance(device, str) and device == "cpu")
                counter._host_factory += to_host
                try:
                    out = fn(*args, **kwargs)
                finally:
                    counter._host_factory -= to_host
                if not counter._suspended and isinstance(out, torch.Tensor):
                    if not to_host and name in FROM_HOST_DATA:
                        counter.h2d(f"torch.{name}(..., device=...)")
                    counter._mark(out, to_host)
                return out
            return wrapper

        T.to, T.cpu, T.cuda, T.tolist, T.numpy = to, cpu, cuda, tolist, numpy
        for name, fn in factories.items():
            setattr(torch, name, factory(name, fn))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(T, name, fn)
            for name, fn in factories.items():
                setattr(torch, name, fn)

    @contextlib.contextmanager
    def tracking(self) -> Iterator["StepCounter"]:
        """Active, not counting: learn which tensors a design keeps on the host."""
        with self._patched(), self:
            yield self

    def count(self, fn: Callable[[], object], engine=None) -> StepCounts:
        """Counts of one call of fn (a whole step); with `engine`, ops are split by stage."""
        self.reset()
        self.stack = []
        self.base_label = "step" if engine is None else GLUE
        with self._patched(), self:
            self.counting = True
            try:
                if engine is None:
                    fn()
                else:
                    with instrument_engine(engine, self.enter, self.leave):
                        fn()
            finally:
                self.counting = False
        if engine is None:
            self.counts.by_stage = {}  # one stage: the whole step
        return self.counts


def _bool_index(name: str, args) -> bool:
    if name not in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))
