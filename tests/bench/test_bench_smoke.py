"""Smoke tests of the bench at tiny sizes: every design does the same work (same frames),
the whole-step counter sees staging and output, the targets are computed, the report renders."""

from __future__ import annotations

import pytest
import torch

from mtp_fsm._util.threads import torch_threads
from mtp_fsm.bench.counters import StepCounter
from mtp_fsm.bench.step_counts import constant_in_batch, count_call, count_design_step, engine_counts_by_batch
from mtp_fsm.bench.drivers import DRIVERS, LIFECYCLE_DESIGNS, check_same_frames, make_drivers, make_requests
from mtp_fsm.bench.null_model import NullInputs, NullTalker, lifecycle_config, qwen3_tts_sizes
from mtp_fsm.bench.report import markdown_report, markdown_table
from mtp_fsm.bench.run import evaluate_targets
from mtp_fsm.bench.timing import bench_batch

SMALL = lifecycle_config(max_context=32)
REAL = qwen3_tts_sizes(max_context=32)
MACHINE = {"date": "today", "cpu": "cpu", "cores": 2, "torch_threads": 1, "python": "3", "torch": "2", "transitions": "0.9"}


@pytest.mark.parametrize("config", [SMALL, REAL], ids=["small_vocab", "real_vocab"])
def test_floor_engine_and_drivers_publish_the_same_frames(config):
    requests = make_requests(3, NullInputs(3))
    drivers = {name: DRIVERS[name](NullTalker(config), requests) for name in DRIVERS}
    assert list(drivers) == ["floor", *LIFECYCLE_DESIGNS]
    with torch_threads(1):
        outputs = {name: d.frames(d.admit()) for name, d in drivers.items()}
        assert check_same_frames(outputs) == {name: 3 for name in drivers}
        for step in range(2):
            outputs = {name: d.frames(d.step()) for name, d in drivers.items()}
            assert set(check_same_frames(outputs).values()) == {3}  # same ids, frame indices and codes
    assert sorted(i for _, i, _ in outputs["floor"]) == [2] * 3
    codes = [c for _, _, c in outputs["floor"]]
    assert all(len(c) == config.num_codebooks for c in codes)
    assert max(max(c) for c in codes) < config.codebook_size


def test_make_drivers_defaults_to_the_lifecycle_designs():
    drivers = make_drivers(lambda: NullTalker(SMALL), make_requests(2, NullInputs(3)))
    assert tuple(drivers) == LIFECYCLE_DESIGNS


def test_transitions_driver_shares_one_static_machine(monkeypatch):
    from transitions import Machine

    built = []
    original = Machine.__init__

    def counting_init(self, *args, **kwargs):
        built.append(kwargs.get("model", args[0] if args else None))
        original(self, *args, **kwargs)

    monkeypatch.setattr(Machine, "__init__", counting_init)
    driver = DRIVERS["transitions"](NullTalker(SMALL), make_requests(6, NullInputs(3)))
    assert built == [None]  # one machine, static (model=None), for the driver
    driver.admit()
    driver.step()
    assert len(built) == 1  # none per request


def test_counter_sees_host_staging_and_output_copies():
    dev = torch.device("cpu")  # a torch.device target reads as "the device"
    table = torch.zeros(8, device=dev)
    counter = StepCounter()

    def step():
        idx = torch.tensor([1, 2, 3]).to(dev)  # host data staged: one H2D
        table[idx] += 1  # device op
        host = torch.arange(3)  # a host factory (no device): a host op only
        _ = (host * 2).sum()
        picked = table[torch.tensor([0, 1])]  # host data used by a device op: an implicit H2D
        out = table.to("cpu", copy=True)  # one D2H (and its sync)
        out.numpy()  # a host tensor: nothing more
        picked.tolist()  # a device read: D2H + sync
        table.nonzero()  # a data-dependent op: a sync

    c = counter.count(step)
    assert (c.h2d, c.d2h, c.syncs) == (2, 2, 3), c.sites
    assert c.host_ops >= 2 and c.device_ops >= 3
    assert c.by_stage == {}


def test_whole_step_counts_floor_engine_and_naive():
    with torch_threads(1):
        counts = {name: count_design_step(lambda: DRIVERS[name](NullTalker(SMALL), make_requests(2, NullInputs(3))))[1]
                  for name in DRIVERS}
    floor = counts["floor"]
    assert (floor.h2d, floor.d2h, floor.syncs, floor.host_ops) == (0, 1, 1, 0), floor.sites
    engine = counts["engine"]
    assert engine.d2h >= 1 and engine.kernels > floor.kernels
    assert sum(engine.by_stage.values()) == engine.kernels  # every op of the whole step, split by stage
    for name in ("transitions", "dict_loop"):
        assert counts[name].h2d > 0 and counts[name].syncs >= 2, counts[name].sites


def test_engine_counts_flat_in_batch_and_naive_counts_grow():
    with torch_threads(1):
        counts = engine_counts_by_batch(lambda: NullTalker(SMALL), (2, 8), NullInputs(3))
    constant, diffs = constant_in_batch(counts)
    assert constant, diffs
    assert all(c["decode"].kernels > 0 and c["decode"].d2h >= 1 for c in counts.values())
    per_batch = {}
    for b in (1, 4):
        driver = DRIVERS["dict_loop"](NullTalker(SMALL), make_requests(b, NullInputs(3)))
        driver.admit()
        per_batch[b] = count_call(driver.step).kernels
    assert per_batch[4] > per_batch[1]


def _row(batch: int, times: dict[str, list[float]]) -> dict:
    """A sweep row with given per-repetition step times (ms, the same on both clocks)."""
    from mtp_fsm.bench.timing import paired, summary_ms

    secs = {d: [t / 1e3 for t in ts] for d, ts in times.items()}
    designs = {}
    for d, ts in secs.items():
        s = summary_ms(ts)
        s["cpu"] = summary_ms(ts)
        for clock in ("wall", "cpu"):
            s.update({f"{k}_{clock}": v for k, v in paired(secs, d, "floor").items()})
        s["times_ms"] = {"wall": times[d], "cpu": times[d]}
        s.update(frames_per_step=[batch], setup_ms=0.0, admit_prefill_step_ms=0.0)
        designs[d] = s
    return {"batch": batch, "reps": len(times["floor"]), "reference": "floor", "designs": designs}


def _results(sweep: dict) -> dict:
    return {"machine": MACHINE, "lifecycle": {"config": {"num_codebooks": 16, "backbone_vocab_size": 3072,
                                                         "codebook_size": 2048}, "vocab": "real", "clock": "cpu",
                                              "sweep": sweep}}


def test_targets_are_computed_from_the_measurements():
    good = {
        1: _row(1, {"floor": [2.0, 2.0], "engine": [2.2, 2.2], "transitions": [3.0, 3.0], "dict_loop": [2.6, 2.6]}),
        8: _row(8, {"floor": [5.0, 5.0], "engine": [5.5, 5.5], "transitions": [9.0, 9.0], "dict_loop": [6.0, 6.0]}),
        64: _row(64, {"floor": [40.0, 40.0], "engine": [42.0, 42.0], "transitions": [50.0, 50.0],
                      "dict_loop": [45.0, 45.0]}),
        256: _row(256, {"floor": [100.0, 100.0], "engine": [101.0, 101.0], "transitions": [130.0, 130.0],
                        "dict_loop": [110.0, 110.0]}),
        1024: _row(1024, {"floor": [400.0, 400.0], "engine": [400.8, 400.8], "transitions": [520.0, 520.0],
                          "dict_loop": [440.0, 440.0]}),
    }
    targets = evaluate_targets(_results(good))
    assert len(targets) == 4 and all(set(t) >= {"name", "measured", "target", "met"} for t in targets)
    assert [t["met"] for t in targets] == [True, True, True, True], targets
    assert targets[0]["measured"] == pytest.approx({"1": 1.1, "64": 1.05, "256": 1.01, "1024": 1.002})
    assert targets[1]["measured"] == pytest.approx(30.0)  # 30 ms / 1 ms
    assert targets[2]["measured"] == pytest.approx(0.8 / 0.5)
    assert targets[3]["measured"] == pytest.approx(2.2 / 2.6)

    bad = dict(good)
    bad[1] = _row(1, {"floor": [2.0, 2.0], "engine": [4.0, 4.0], "transitions": [3.0, 3.0], "dict_loop": [2.6, 2.6]})
    bad[1024] = _row(1024, {"floor": [400.0, 400.0], "engine": [450.0, 450.0], "transitions": [520.0, 520.0],
                            "dict_loop": [440.0, 440.0]})
    targets = evaluate_targets(_results(bad))
    assert [t["met"] for t in targets] == [False, True, False, False], targets
    assert targets[2]["measured"] == pytest.approx(50.0 / 0.5)

    partial = evaluate_targets(_results({8: good[8]}))
    assert len(partial) == 4 and not any(t["met"] for t in partial)
    assert all(t["measured"] is None for t in partial)

    # An engine faster than the floor in most repetitions: its overhead is noise, so the
    # ratio targets built on it are unresolved (never claimed met), whatever they compute to.
    noisy = dict(good)
    noisy[256] = _row(256, {"floor": [100.0, 103.0], "engine": [98.0, 101.0], "transitions": [130.0, 133.0],
                            "dict_loop": [104.0, 107.0]})
    noisy[1024] = _row(1024, {"floor": [400.0, 420.0], "engine": [380.0, 399.0], "transitions": [520.0, 540.0],
                              "dict_loop": [440.0, 460.0]})
    targets = evaluate_targets(_results(noisy))
    assert [t["met"] for t in targets] == [True, False, False, True], targets
    assert "below this run's noise" in targets[1]["unresolved"] and "B=1024" in targets[2]["unresolved"]
    from mtp_fsm.bench.report import _target_line
    assert "**unresolved**" in _target_line(targets[1]) and "**met**" in _target_line(targets[0])


def test_bench_batch_and_report():
    with torch_threads(1):
        row = bench_batch(SMALL, 2, tuple(DRIVERS), budget_s=0.0, min_reps=2, max_reps=2, log=lambda _: None)
    assert row["frames_identical"] and row["reps"] == 2 and row["reference"] == "floor"
    for name in DRIVERS:
        d = row["designs"][name]
        assert d["frames_per_step"] == [2] and len(d["times_ms"]["cpu"]) == 2
        assert {"overhead_ms_wall", "overhead_ms_cpu", "ratio_cpu", "counts"} <= set(d)
    assert row["designs"]["floor"]["overhead_ms_cpu"] == 0.0
    results = _results({2: row})
    results["lifecycle"]["config"] = {"num_codebooks": 16, "backbone_vocab_size": 96, "codebook_size": 64}
    results["lifecycle"]["vocab"] = "small"
    results["targets"] = evaluate_targets(results)
    table = markdown_table(results)
    assert "| 2 |" in table and "floor ms" in table and "engine overhead ms" in table
    assert "NOT the real ones" in table and "repetitions per batch size: B=2: 2" in table
    assert "H2D" in table and table.count("**missed**") == 4
    report = markdown_report(results)
    assert "# mtp_fsm bench results" in report and "The same steps on the other clock" in report


def test_speculative_bench_runs_every_k_on_the_same_frames_and_renders():
    from mtp_fsm.bench.speculative import bench_speculative, speculative_table

    with torch_threads(1):
        section = bench_speculative({"tiny": dict(ks=(0, 2), batches=(2,), max_frames=6)}, rounds=1, log=lambda _: None)
    rows = {(r["workload"], r["k"], r["policy"]): r for r in section["rows"]}
    assert set(rows) == {(w, k, p) for w in ("greedy", "sampled") for k, p in ((0, "plain"), (2, "fixed"), (2, "adaptive"))}
    plain, fixed, adaptive = rows["greedy", 0, "plain"], rows["greedy", 2, "fixed"], rows["greedy", 2, "adaptive"]
    assert plain["frames"] == fixed["frames"] == adaptive["frames"] > 0  # bench_speculative also raises on a mismatch
    assert 0.0 <= fixed["acceptance"] <= 1.0 and fixed["frames_per_verify_row"] >= 1.0
    assert fixed["drafts_per_verify_row"] == 2.0 and 0.0 <= adaptive["drafts_per_verify_row"] <= 2.0
    assert section["speed_vs_k0"]["tiny"]["sampled"]["2"]["0"] == 1.0
    assert section["speed_vs_k0"]["tiny"]["greedy"]["2"]["2"] == adaptive["speed_vs_k0"] > 0
    assert section["speed_vs_k0_fixed"]["tiny"]["greedy"]["2"]["2"] == fixed["speed_vs_k0"] > 0
    # The adaptive pass's costs are the fixed pass's step ratios (d = 1 between d = 0 and d = 2).
    costs = section["step_costs"]["tiny"]["greedy"]["2"]
    assert costs[0] == 1.0 and costs[2] == fixed["step_vs_k0"] and costs[1] == (1.0 + costs[2]) / 2
    table = speculative_table(section)
    assert "| tiny | greedy | 2 | 2 | adaptive |" in table and "| tiny | sampled | 2 | 0 | plain |" in table
    assert section["targets"] == []  # no target is measured at B=2


def test_speculative_targets_are_judged_on_the_worst_k():
    from mtp_fsm.bench.speculative import judge

    rows = [dict(model="tiny", workload="sampled", batch=8, k=k, speed_vs_k0=v, step_vs_k0=1.0)
            for k, v in ((0, 1.0), (1, 1.2), (2, 0.85))]
    (target,) = judge({"rows": rows})
    assert not target["met"] and target["values"] == {1: 1.2, 2: 0.85}
    rows[2]["speed_vs_k0"] = 0.95
    assert judge({"rows": rows})[0]["met"]


def test_the_speech_out_section_judges_the_lowest_ratio():
    from mtp_fsm.bench.report import audio_section

    row = dict(model="qwen3_tts", frames_per_s_off=100.0, frames_per_s_on=95.0, ratio=0.95, first_audio_ms_p50=10.0,
               first_audio_ms_p95=12.0, decoder_rtf=0.02, stream_rtf_p50=1.1)
    assert "**met** (lowest 0.950)" in audio_section([row])
    slow = dict(row, model="higgs_audio_v3", frames_per_s_on=80.0, ratio=0.8)
    text = audio_section([row, slow])
    assert "**missed** (lowest 0.800)" in text and "| higgs_audio_v3 | 100.0 | 80.0 | 0.800 |" in text


def test_decode_path_counts_the_library_files_one_decode_step_calls_into():
    from mtp_fsm.bench.decode_path import decode_path

    path = decode_path(batch=2)
    files = path["files"]
    # The step's own layers are seen; the bench's NullTalker and drivers are not the library's code.
    for needed in ("mtp_fsm/engine/engine.py", "mtp_fsm/engine/step_inputs.py", "mtp_fsm/sampling/sampler.py"):
        assert files[needed]["calls"] >= 1, needed
    assert not any(name.startswith("mtp_fsm/bench/") for name in files)
    assert "mtp_fsm/engine/admission.py" not in files  # a steady decode step admits nothing
    assert path["num_files"] == len(files) and path["lines"] == sum(f["lines"] for f in files.values())


def test_a_skipped_section_keeps_its_previous_measurement_with_its_date(tmp_path):
    import json

    from mtp_fsm.bench.report import carried_words
    from mtp_fsm.bench.run import carry_over

    previous = tmp_path / "results.json"
    previous.write_text(json.dumps({"machine": {"date": "2026-01-01"}, "audio": [1], "e2e": {"x": 2},
                                    "carried_over": {"e2e": "2025-12-31"}}))
    results, lines = {"machine": {"date": "today"}}, []
    carry_over(results, {"audio", "e2e", "serving"}, str(previous), lines.append)
    assert results["audio"] == [1] and results["e2e"] == {"x": 2} and "serving" not in results
    # A section already carried keeps its first date, not the run that carried it.
    assert results["carried_over"] == {"audio": "2026-01-01", "e2e": "2025-12-31"}
    assert carried_words(results) == "; kept from earlier runs: audio (2026-01-01), e2e (2025-12-31)"
    fresh = {"machine": {}}
    carry_over(fresh, set(), str(previous), lines.append)  # nothing skipped: nothing carried
    assert "carried_over" not in fresh and carried_words(fresh) == ""
