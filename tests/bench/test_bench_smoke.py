"""Smoke test of the bench: drivers agree frame for frame, op counts are flat in the batch size."""

from __future__ import annotations

from mtp_fsm.bench.counters import constant_in_batch, count_call, engine_counts_by_batch
from mtp_fsm.bench.drivers import DRIVERS, check_same_frames, make_drivers, make_requests
from mtp_fsm.bench.null_model import NullInputs, NullTalker, lifecycle_config
from mtp_fsm.bench.report import markdown_report, markdown_table
from mtp_fsm.bench.run import evaluate_targets
from mtp_fsm.bench.timing import bench_batch
from mtp_fsm.testing.alone import torch_threads

CONFIG = lifecycle_config(max_context=32)


def _model() -> NullTalker:
    return NullTalker(CONFIG)


def test_drivers_publish_the_same_frames_every_step():
    requests = make_requests(4, NullInputs(3))
    drivers = make_drivers(_model, requests)
    assert set(drivers) == set(DRIVERS)
    outputs = {name: d.frames(d.admit()) for name, d in drivers.items()}
    assert check_same_frames(outputs) == {name: 4 for name in drivers}
    for _ in range(2):
        outputs = {name: d.frames(d.step()) for name, d in drivers.items()}
        counts = check_same_frames(outputs)  # same ids, frame indices and codes
        assert set(counts.values()) == {4}
    # Frame indices advance 0, 1, 2 for every request.
    assert sorted(i for _, i, _ in outputs["engine"]) == [2] * 4


def test_engine_op_counts_are_flat_in_batch_and_sync_at_most_once():
    counts = engine_counts_by_batch(_model, (2, 8), NullInputs(3))
    constant, diffs = constant_in_batch(counts)
    assert constant, diffs
    for by_phase in counts.values():
        decode = by_phase["decode"]
        assert decode.syncs + decode.d2h <= 1, decode.sites
        assert decode.kernels > 0 and decode.by_stage


def test_naive_counts_grow_with_batch():
    per_batch = {}
    for b in (1, 4):
        driver = DRIVERS["dict_loop"](_model(), make_requests(b, NullInputs(3)))
        driver.admit()
        per_batch[b] = count_call(driver.step).kernels
    assert per_batch[4] > per_batch[1]


def test_bench_batch_and_report():
    with torch_threads(1):
        row = bench_batch(CONFIG, 2, tuple(DRIVERS), budget_s=0.0, min_reps=2, log=lambda _: None)
    assert row["frames_identical"] and row["reps"] == 2
    for name in DRIVERS:
        assert row["designs"][name]["frames_per_step"] == [2]
    results = {
        "machine": {"date": "today", "cpu": "cpu", "cores": 2, "torch_threads": 1, "python": "3", "torch": "2",
                    "transitions": "0.9"},
        "lifecycle": {"config": {"num_codebooks": 16, "backbone_vocab_size": 96, "codebook_size": 64},
                      "sweep": {2: row}},
    }
    results["targets"] = evaluate_targets(results)
    table = markdown_table(results)
    assert "| 2 |" in table and "×engine" in table
    assert "# mtp_fsm bench results" in markdown_report(results)
