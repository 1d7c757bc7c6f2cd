"""The per-model engine step bench: result structure at a tiny size (no timing assertions)."""

from __future__ import annotations

from mtp_fsm.bench.model_step import NOT_BENCHED, bench_model, bench_texts, lifecycle_shape, model_names
from mtp_fsm.bench.report import markdown_report, models_table
from mtp_fsm.serving.model_loader import MODEL_NAMES
from mtp_fsm.testing.alone import torch_threads


def test_model_names_are_the_loaders_talkers():
    assert set(model_names()) == set(MODEL_NAMES) - set(NOT_BENCHED) and set(NOT_BENCHED) <= set(MODEL_NAMES)
    texts = bench_texts(5, 30)
    assert len(set(texts)) == 5 and all(0 < len(t) <= 30 for t in texts)


def test_one_model_at_tiny_size_and_the_report():
    with torch_threads(1):
        m = bench_model("chatterbox", (1, 3), budget_s=0.0, min_steps=2, max_steps=2, warmup=1, log=lambda _: None)
    assert "skipped" not in m, m.get("skipped")
    assert m["import"] == MODEL_NAMES["chatterbox"] and m["kernels"] == "torch" and m["max_slots"] == 64
    assert {k: m[k] for k in ("variant", "states", "edges")} == lifecycle_shape(m["variant"])
    assert m["states"] > 0 and m["edges"] > 0 and m["steps"] == 2
    assert set(m["batches"]) == {1, 3}
    for b, row in m["batches"].items():
        assert row["batch"] == b and "problem" not in row, row
        assert row["n"] == 2 and row["median_ms"] > 0 and row["frames_per_s"] >= 0
        assert 1 <= row["rows_decoding"]["min"] <= row["rows_decoding"]["max"] <= b
        assert set(row) >= {"p10_ms", "p90_ms", "frames_per_step", "per_frame_ms", "refills", "finish_reasons"}
    if m["batches"][1]["per_frame_ms"] and m["batches"][3]["per_frame_ms"]:
        assert m["per_frame_ratio"] > 0

    skipped = bench_model("models.no_such_talker:tiny_demo_talker", (1, 3), log=lambda _: None)
    assert "no_such_talker" in skipped["skipped"] and "batches" not in skipped

    section = {"batch_sizes": [1, 3], "kernels": "torch", "max_slots": 64,
               "models": {"chatterbox": m, "missing": skipped}}
    table = models_table(section)
    assert f"| chatterbox | {m['variant']} | {m['states']} | {m['edges']} |" in table
    assert "| missing | skipped: " in table and "B=3 ms/step" in table
    results = {
        "machine": {"date": "today", "cpu": "cpu", "cores": 2, "torch_threads": 1, "python": "3", "torch": "2",
                    "transitions": "0.9"},
        "lifecycle": {"config": {"num_codebooks": 16, "backbone_vocab_size": 3072, "codebook_size": 2048},
                      "clock": "cpu", "sweep": {2: {"batch": 2, "reps": 1, "reference": "floor", "designs": {
                          name: {"median_ms": 1.0, "p10_ms": 1.0, "p90_ms": 1.0, "n": 1,
                                 "cpu": {"median_ms": 1.0, "p10_ms": 1.0, "p90_ms": 1.0, "n": 1},
                                 "overhead_ms_wall": 0.0, "ratio_wall": 1.0, "overhead_ms_cpu": 0.0, "ratio_cpu": 1.0,
                                 "times_ms": {"wall": [1.0], "cpu": [1.0]}, "frames_per_step": [2], "setup_ms": 0.0,
                                 "admit_prefill_step_ms": 0.0}
                          for name in ("floor", "engine")}}}},
        "models": section,
    }
    assert "## Engine step per talker model" in markdown_report(results)
