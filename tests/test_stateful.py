"""The lifecycle state machine (mtp_fsm.testing.stateful) against the engine, for every
lifecycle variant's scripted talker (MTP, single-codebook, MTP-decided stop, conditioned:
rows of a conditioning feed arriving late, the starved state; delay pattern: ramp-up and
EOC wind-down; stop head: a float payload, the stop frame published), plus coverage of every declared transition.

Run with `-s` to see example counts, steps, frames and time per variant.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from mtp_fsm.lifecycle import compile_lifecycle, lifecycle_for
from mtp_fsm.testing.alone import torch_threads
from mtp_fsm.testing.alone import scripted_conditioned, scripted_delay, scripted_mtp_stop, scripted_stop_head
from mtp_fsm.testing.stateful import COVERAGE, STATS, LifecycleMachine, lifecycle_test_case, scripted_mtp, scripted_single

# Tuned so the whole file runs in about 2 minutes on 2 cores, with the rarest edge of each variant
# firing 5+ times. Derandomized: hypothesis seeds from the test's code (and its file path), so a
# checkout replays the same examples run after run; another path draws another fixed sample.
CHECKS = [HealthCheck.too_slow, HealthCheck.filter_too_much]


def _settings(max_examples: int):
    return settings(max_examples=max_examples, stateful_step_count=40, deadline=None, suppress_health_check=CHECKS,
                    derandomize=True)


SETTINGS = {"mtp": _settings(100), "single_codebook": _settings(70), "mtp_stop": _settings(70),
            "conditioned": _settings(80), "stop_head": _settings(70), "delay_pattern": _settings(130)}
FACTORIES = {"mtp": scripted_mtp, "single_codebook": scripted_single, "mtp_stop": scripted_mtp_stop,
             "conditioned": scripted_conditioned, "delay_pattern": scripted_delay,
             "stop_head": scripted_stop_head}

_RUNS: dict[str, object] = {}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


def _run(variant: str, run_settings) -> tuple[Counter, Counter, float]:
    before_cov, before_stats = Counter(COVERAGE[variant]), Counter(STATS[variant])
    start = time.perf_counter()
    run_state_machine_as_test(lambda: LifecycleMachine(FACTORIES[variant]), settings=run_settings)
    stats = STATS[variant] - before_stats
    seconds = time.perf_counter() - start
    print(f"\n[stateful {variant}] {stats['examples']} examples, {stats['steps']} steps, {stats['frames']} frames "
          f"({stats['batched_steps']} steps publishing >= 2, {stats['mixed_steps']} mixed/padded sampling steps), "
          f"{stats['rejected']} rejected plans"
          + (f", {stats['starves']} starves, {stats['feeds']} feeds ({stats['fed_rows']} rows fed)"
             if stats["starves"] or stats["fed_rows"] else "") + f", {seconds:.1f}s")
    return COVERAGE[variant] - before_cov, stats, seconds


def run_machine(variant: str):
    """Run the machine once per variant per session (memoised, so test order does not matter)."""
    if variant not in _RUNS:
        try:
            _RUNS[variant] = _run(variant, SETTINGS[variant])
        except BaseException as exc:
            _RUNS[variant] = exc
            raise
    result = _RUNS[variant]
    if isinstance(result, BaseException):
        pytest.fail(f"the {variant} state machine failed: {result!r}")
    return result


@pytest.mark.parametrize("variant", list(FACTORIES))
def test_lifecycle_machine(variant):
    run_machine(variant)


@pytest.mark.parametrize("variant", list(FACTORIES))
def test_every_declared_transition_fires(variant):
    """Every (trigger, source) pair of the variant's compiled table fired in the oracle at
    least once over the machine's run (runs the machine first if it has not run yet)."""
    coverage, stats, _ = run_machine(variant)
    coverage, stats = Counter(coverage), Counter(stats)
    edges = compile_lifecycle(lifecycle_for(variant)).edges()

    def missing():
        return [f"{t.label} from {s.label}" for t, s, _ in edges if coverage[(t, s)] == 0]

    assert missing() == [], f"never fired in {stats['examples']} examples / {stats['steps']} steps"
    rarest = min((coverage[(t, s)], f"{t.label} from {s.label}") for t, s, _ in edges)
    print(f"\n[coverage {variant}] {len(edges)} edges, rarest {rarest[1]!r}: {rarest[0]} times")
    assert set(coverage) <= {(t, s) for t, s, _ in edges}  # nothing fired outside the table


def test_lifecycle_test_case_helper_builds_a_runnable_test_case():
    """The TestCase helper binds the factory and engine kwargs (a short run: 3 examples)."""
    case = lifecycle_test_case(scripted_single, max_slots=2, settings=settings(
        max_examples=3, stateful_step_count=10, deadline=None, suppress_health_check=list(HealthCheck)))
    result = case("runTest").run()
    assert result.wasSuccessful(), result.failures + result.errors
