"""The embedded engine thread's command collection: an idle engine takes a request's whole burst (up to the
event loop's mark and a short gap after it), a busy one only what waits; order is kept."""

from __future__ import annotations

import queue
import threading
import time

from mtp_fsm.api.embedded import collect_commands


def filled(*commands) -> queue.SimpleQueue:
    q = queue.SimpleQueue()
    for c in commands:
        q.put(c)
    return q


def test_a_busy_engine_takes_what_waits_in_order_and_nothing_more():
    q = filled(("submit", "a"), ("abort", "x"), ("mark", None))
    assert collect_commands(q, block=False) == [("submit", "a"), ("abort", "x"), ("mark", None)]
    assert collect_commands(q, block=False) == []


def test_an_idle_engine_waits_for_the_mark_of_the_loop_iteration_that_submitted():
    # The rest of the burst and its mark come 50 ms later: a fixed gap after the first submit would have
    # started the step without them; the collection waits for the mark (max_s bounds it).
    q = filled(("submit", "a"))

    def later() -> None:
        time.sleep(0.05)
        q.put(("submit", "b"))
        q.put(("mark", None))

    thread = threading.Thread(target=later)
    thread.start()
    try:
        got = collect_commands(q, block=True, gap_s=0.001, max_s=10.0)
    finally:
        thread.join()
    assert got == [("submit", "a"), ("submit", "b"), ("mark", None)]


def test_after_the_mark_a_submit_within_the_gap_joins_and_is_marked_in_turn():
    q = filled(("submit", "a"), ("mark", None), ("submit", "b"))

    def later() -> None:
        time.sleep(0.05)
        q.put(("mark", None))

    thread = threading.Thread(target=later)
    thread.start()
    try:
        got = collect_commands(q, block=True, gap_s=0.001, max_s=10.0)  # b reopened the burst: wait for its mark
    finally:
        thread.join()
    assert got == [("submit", "a"), ("mark", None), ("submit", "b"), ("mark", None)]


def test_the_burst_ends_a_gap_after_its_last_mark():
    q = filled(("submit", "a"), ("mark", None))
    began = time.monotonic()
    assert collect_commands(q, block=True, gap_s=0.0, max_s=10.0) == [("submit", "a"), ("mark", None)]
    assert time.monotonic() - began < 5.0  # not max_s: marked, and nothing came in the gap


def test_an_idle_engine_does_not_wait_after_an_abort_or_a_stale_mark():
    for first in (("abort", "x"), ("mark", None)):
        q = filled(first)
        began = time.monotonic()
        assert collect_commands(q, block=True, gap_s=10.0, max_s=10.0) == [first]
        assert time.monotonic() - began < 5.0


def test_the_gap_after_a_mark_widens_with_the_bursts_own_spacing():
    # a, then b 200 ms later (its mark not yet come, so b joins): c 100 ms after b's mark still joins
    # (the widest spacing, 200 ms), where a fixed 1 ms gap would have started the step without it; then
    # the burst ends (not at max_s).
    q = filled(("submit", "a"))

    def later() -> None:
        time.sleep(0.2)
        q.put(("submit", "b"))
        q.put(("mark", None))
        time.sleep(0.1)
        q.put(("submit", "c"))
        q.put(("mark", None))

    thread = threading.Thread(target=later)
    thread.start()
    began = time.monotonic()
    try:
        got = collect_commands(q, block=True, gap_s=0.001, max_s=10.0)
    finally:
        thread.join()
    assert [c for c in got if c[0] == "submit"] == [("submit", "a"), ("submit", "b"), ("submit", "c")]
    assert time.monotonic() - began < 5.0
