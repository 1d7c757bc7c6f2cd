"""What a soak measured: its report (counts, throughput, problems) and the memory probes behind it."""

from __future__ import annotations

import gc
import os
import resource
import sys
from typing import TYPE_CHECKING

import attrs
import torch

from .chunking import ChunkingSink
from .runner import ServingLoop

if TYPE_CHECKING:
    from .soak import SoakConfig


@attrs.frozen
class MemorySample:
    fraction: float  # of the requests finished
    tensors: int  # live torch tensors (gc-tracked)
    records: int  # retained records: metrics, chunker, engine ledger and scheduler
    rss_mb: float


@attrs.define
class SoakReport:
    config: SoakConfig
    finished: int = 0
    steps: int = 0
    frames: int = 0
    wall_s: float = 0.0
    by_reason: dict[str, int] = attrs.field(factory=dict)
    aborts_requested: int = 0
    aborts_queued: int = 0  # of which the request was still queued (dropped at once)
    preempts_requested: int = 0
    preemptions: int = 0  # all the engine ran: the policy's and the explicit ones
    faults: int = 0
    fault_ended: int = 0
    eos_first: int = 0
    first_audio_of_no_audio: int = 0
    audio_chunks: int = 0
    samples: list[MemorySample] = attrs.field(factory=list)
    peak_rss_mb: float = 0.0
    problems: list[str] = attrs.field(factory=list)
    num_problems: int = 0

    @property
    def requests_per_s(self) -> float:
        return self.finished / self.wall_s if self.wall_s > 0 else 0.0

    def problem(self, text: str) -> None:
        self.num_problems += 1
        if len(self.problems) < 50:
            self.problems.append(text)

    def growth(self, field: str, start: float = 0.25) -> int:
        """How much `field` (tensors / records) grew from the first sample at >= `start` of the run to the max after."""
        later = [getattr(s, field) for s in self.samples if s.fraction >= start]
        return max(later) - later[0] if later else 0

    def table(self) -> str:
        c = self.config
        rows = [
            ("model", f"{c.model}, {c.max_slots} slots, budget {c.token_budget}, chunk {c.prefill_chunk}, "
                      f"preempt after {c.preempt_after_steps}"),
            ("requests finished", f"{self.finished} of {c.requests}"),
            ("by reason", ", ".join(f"{k}={v}" for k, v in sorted(self.by_reason.items()))),
            ("steps / frames", f"{self.steps} / {self.frames}"),
            ("wall time", f"{self.wall_s:.1f} s"),
            ("requests/s", f"{self.requests_per_s:.1f}"),
            ("frames/s", f"{self.frames / self.wall_s if self.wall_s else 0:.1f}"),
            ("client aborts", f"{self.aborts_requested} ({self.aborts_queued} queued, "
                              f"{self.aborts_requested - self.aborts_queued} running)"),
            ("explicit preempts", str(self.preempts_requested)),
            ("preemptions run", str(self.preemptions)),
            ("injected faults", f"{self.faults} ({self.fault_ended} requests ended by them)"),
            ("EOS-first requests", str(self.eos_first)),
            ("audio chunks", str(self.audio_chunks)),
            ("live tensors", " ".join(f"{s.tensors}" for s in self.samples) + f" (growth after 25%: "
                                                                               f"{self.growth('tensors')})"),
            ("retained records", " ".join(f"{s.records}" for s in self.samples) + f" (growth after 25%: "
                                                                                  f"{self.growth('records')})"),
            ("RSS MB", " ".join(f"{s.rss_mb:.0f}" for s in self.samples) + f" (peak {self.peak_rss_mb:.0f})"),
            ("problems", str(self.num_problems)),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def retained_records(loop: ServingLoop, chunker: ChunkingSink) -> int:
    """Records held by the serving stack: metrics, chunker, the engine's ledger and policy."""
    ledger, scheduler = loop.engine.ledger, loop.engine.scheduler
    held = sum(loop.metrics.retained().values()) + sum(chunker.retained().values())
    # The engine's own bookkeeping (read defensively: these are its internals).
    parts = [(ledger, "records"), (ledger, "queued"), (ledger.admission, "_prepared"),
             (scheduler, "_aborts"), (scheduler, "_preempts"), (scheduler, "_preempted")]
    return held + sum(len(getattr(owner, name, ())) for owner, name in parts)
