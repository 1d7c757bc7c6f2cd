"""Soak: thousands of short requests through ServingLoop + the built-in policy, with client
aborts (queued and running), explicit and policy preemptions and injected model faults.
Every request ends once, with its reference frames (a prefix when cut short), every slot is
free at the end, and live tensors and retained records stay flat. `make soak` runs a long one."""

import re

import pytest

from mtp_fsm.serving import soak
from mtp_fsm.serving.soak import SoakConfig, run_soak


def test_soak_scripted_serving_stays_correct_and_flat():
    config = SoakConfig(requests=3000, seed=0)
    report = run_soak(config)
    table = report.table()
    assert report.num_problems == 0, table
    assert report.finished == config.requests, table
    # It exercised what it is meant to: every way to end, both kinds of abort, both kinds of
    # preemption, faults, and requests whose first sample is EOS (no audio at all).
    assert set(report.by_reason) == {"abort", "eos", "error", "length"}, table
    assert 0 < report.aborts_queued < report.aborts_requested, table
    assert report.preempts_requested > 0 and report.preemptions > report.preempts_requested, table
    assert report.faults > 0 and report.fault_ended > 0 and report.eos_first > 0, table
    assert report.first_audio_of_no_audio == 0, table
    # Memory: samples from 25% to 100% of the run do not grow beyond in-flight noise.
    assert len(report.samples) == config.samples
    assert report.growth("tensors") <= soak.tensor_slack(config), table
    assert report.growth("records") <= soak.record_slack(config), table


def test_soak_detects_unbounded_retention():
    # The same serving stack with windows larger than the run keeps a record per request:
    # the sampled record count must show it (the check is not vacuous).
    config = SoakConfig(requests=400, retention=100_000, abort_p=0.0, preempt_p=0.0, fault_p=0.0, check=False)
    report = run_soak(config)
    assert report.num_problems == 0, report.table()
    assert report.growth("records") > soak.record_slack(config)


def test_soak_detects_a_request_ending_twice(monkeypatch):
    from mtp_fsm.serving.runner import ServingLoop

    finish = ServingLoop._finish

    def twice(self, step, finished):
        finish(self, step, finished)
        if finished.request_id == "soak-5":
            self.sinks[0].on_finished(step, finished)  # the checking sink sees a second end

    monkeypatch.setattr(ServingLoop, "_finish", twice)
    report = run_soak(SoakConfig(requests=40, check=False))
    assert any("'soak-5' ended" in p and "a second time" in p for p in report.problems), report.table()


def test_soak_command_line_null_talker(capsys):
    rc = soak.main(["--requests", "300", "--model", "null", "--max-slots", "8", "--max-frames", "3",
                    "--queue-depth", "8", "--pool", "16", "--abort-p", "0.2", "--preempt-p", "0.2", "--samples", "4",
                    "--retention", "32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "requests/s" in out and "peak" in out and "live tensors" in out
    assert re.search(r"^problems\s+0$", out, re.M), out


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--abort-p", "2"], ["--retention", "-1"]])
def test_soak_command_line_rejects_bad_settings(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        soak.main(argv)
    assert exc.value.code == 2 and "error: argument" in capsys.readouterr().err
