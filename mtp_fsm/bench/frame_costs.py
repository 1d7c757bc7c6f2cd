"""What the frame formats cost the engine per step, at the real sizes: VoxCPM2's continuous
payload (a 4 x 64 float32 patch) and Higgs Audio v3's delay pattern (8 codebooks of 1026).

Timed with torch.utils.benchmark on exactly the tensor work the engine adds for such a model
(sampling/gaussian.py, model_api.PayloadSpec, sampling/delay_pattern.py), apart from the
model: models without a payload or a delay pattern run none of it (a host-side branch).
"""

from __future__ import annotations

import torch
from torch.utils import benchmark

from ..model_api import DelayPattern, PayloadSpec
from ..sampling.delay_pattern import DelayRows
from ..sampling.gaussian import gaussian_noise
from ..sampling.noise import frame_key

VOXCPM2_PATCH = PayloadSpec((4, 64), torch.float32)
HIGGS = (8, 1026, DelayPattern(boc=1024, eoc=1025))


def payload_step(keys: torch.Tensor, table_words: torch.Tensor, patch: torch.Tensor) -> torch.Tensor:
    """The engine's payload work in one step (pipeline._payload_frame, engine output): the
    noise draw, the previous payload decoded, the new one checked and encoded, the output's decode."""
    spec = VOXCPM2_PATCH
    gaussian_noise(keys, spec.shape)
    spec.decode(table_words)
    torch.isfinite(patch.reshape(patch.shape[0], -1)).all(dim=1)
    words = spec.encode(patch)
    return spec.decode(words)


def delay_step(frame_index: torch.Tensor, last: torch.Tensor, logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """The engine's delay-pattern work in one step: the rows' constraints, then every codebook's mask."""
    _, _, pattern = HIGGS
    rows = DelayRows(pattern, frame_index, last, last)  # the frame before last: the same layout
    return [rows.apply(x, q) for q, x in enumerate(logits)]


def _median_us(stmt, **globals_) -> float:
    timer = benchmark.Timer(stmt=stmt, globals=globals_, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=0.3).median * 1e6


def bench_frame_costs(batch_sizes=(1, 64), log=print) -> dict:
    out: dict = {"payload_shape": list(VOXCPM2_PATCH.shape), "delay_codebooks": HIGGS[0], "delay_vocab": HIGGS[1],
                 "batches": {}}
    g = torch.Generator().manual_seed(0)
    for b in batch_sizes:
        keys = frame_key(torch.arange(b), torch.full((b,), 7))
        patch = torch.randn(b, *VOXCPM2_PATCH.shape, generator=g)
        words = VOXCPM2_PATCH.encode(patch)
        q, v, _ = HIGGS
        frame_index = torch.randint(0, 12, (b,), generator=g)
        last = torch.randint(0, v, (b, q), generator=g)
        logits = [torch.randn(b, v, generator=g) for _ in range(q)]
        row = {"payload_us": _median_us("payload_step(keys, words, patch)", payload_step=payload_step, keys=keys,
                                        words=words, patch=patch),
               "delay_us": _median_us("delay_step(fi, last, logits)", delay_step=delay_step, fi=frame_index,
                                      last=last, logits=logits)}
        out["batches"][b] = row
        log(f"  B={b}: payload (VoxCPM2 patch 4x64) {row['payload_us']:.0f} us/step, "
            f"delay pattern (Higgs 8 x 1026) {row['delay_us']:.0f} us/step")
    return out
