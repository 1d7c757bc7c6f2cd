"""bench/real_size.py's table: a run limited to some batch sizes (--batches) renders, naming the ratio it could not measure."""

from __future__ import annotations

from mtp_fsm.bench.real_size import real_size_table


def _row(batch: int, step_ms: float) -> dict:
    split = {"backbone": step_ms / 4, "code_predictor": step_ms / 2, "mtp_sampler": 1.0, "engine": 1.0}
    return {"batch": batch, "step": {"median_ms": step_ms}, "per_frame_ms": step_ms / batch, "split_ms": split,
            "probe_gbps": 20.0, "floor_ms": 100.0, "floor_ratio": step_ms / 100.0, "floor_ratio_vs_gemv": 1.0}


def _result(batches: dict[int, float]) -> dict:
    rows = {str(b): _row(b, ms) for b, ms in batches.items()}
    b1 = rows["1"]["floor_ratio"] if "1" in rows else None
    b8 = rows["8"]["per_frame_ms"] / rows["1"]["per_frame_ms"] if {"1", "8"} <= set(rows) else None
    return {"max_context": 512, "steps": 8, "bandwidth": {"sum_gbps": 20.0, "gemv_gbps": 18.0},
            "fp32": {"dtype": "float32", "batches": rows}, "floor_ratio_b1": b1, "per_frame_ratio_b8": b8,
            "targets": {"floor_ratio_b1 <= 1.5": b1 is not None and b1 <= 1.5,
                        "per_frame_ratio_b8 <= 0.35": b8 is not None and b8 <= 0.35}}


def test_full_run_states_both_ratios_against_their_targets():
    last = real_size_table(_result({1: 120.0, 8: 400.0})).splitlines()[-1]
    assert last == ("- floor_ratio_b1 = 1.200 (target <= 1.5: met); "
                    "per_frame_ratio_b8 = 0.417 (target <= 0.35: missed)")


def test_a_run_without_b8_or_b1_names_the_missing_row():
    assert real_size_table(_result({1: 160.0})).splitlines()[-1] == (
        "- floor_ratio_b1 = 1.600 (target <= 1.5: missed); per_frame_ratio_b8 = not measured (no B=8 row)")
    assert real_size_table(_result({8: 400.0})).splitlines()[-1] == (
        "- floor_ratio_b1 = not measured (no B=1 row); per_frame_ratio_b8 = not measured (no B=8 row)")
