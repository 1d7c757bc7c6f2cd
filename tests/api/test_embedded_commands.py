"""The embedded engine thread's command collection: an idle engine takes a hand-over's whole burst (while
the event loop holds requests not handed over yet, then a short gap), a busy one only what waits; order is
kept."""

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


def put_later(q: queue.SimpleQueue, *timed) -> threading.Thread:
    """Put each (delay_s, command) after its delay, in order, from another thread."""
    def run() -> None:
        for delay, command in timed:
            time.sleep(delay)
            q.put(command)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_busy_engine_takes_what_waits_in_order_and_nothing_more():
    q = filled(("submit", ["a"]), ("abort", "x"), ("submit", ["b", "c"]))
    assert collect_commands(q, block=False) == [("submit", ["a"]), ("abort", "x"), ("submit", ["b", "c"])]
    assert collect_commands(q, block=False) == []


def test_a_hand_over_within_the_gap_joins_the_burst():
    q = filled(("submit", ["a"]))
    thread = put_later(q, (0.05, ("submit", ["b"])))
    try:
        got = collect_commands(q, block=True, gap_s=2.0, max_s=10.0)  # b comes well within the 2 s gap
    finally:
        thread.join()
    assert got == [("submit", ["a"]), ("submit", ["b"])]


def test_the_burst_waits_past_the_gap_while_the_event_loop_holds_requests():
    # b is handed over 200 ms after a, far past the 1 ms gap, but the loop held it all along (it was
    # parsing the burst): it joins, and the burst ends a gap after the loop holds nothing.
    q = filled(("submit", ["a"]))
    holding = threading.Event()
    holding.set()

    def hand_over() -> None:
        time.sleep(0.2)
        q.put(("submit", ["b"]))
        holding.clear()

    thread = threading.Thread(target=hand_over)
    thread.start()
    began = time.monotonic()
    try:
        got = collect_commands(q, block=True, gap_s=0.001, max_s=10.0, in_hand=holding.is_set)
    finally:
        thread.join()
    assert got == [("submit", ["a"]), ("submit", ["b"])]
    assert time.monotonic() - began < 5.0  # not max_s


def test_nothing_in_hand_and_nothing_within_the_gap_starts_the_step_without_waiting_for_more():
    q = filled(("submit", ["a"]))
    thread = put_later(q, (0.5, ("submit", ["late"])))
    try:
        got = collect_commands(q, block=True, gap_s=0.001, max_s=10.0, in_hand=lambda: False)
    finally:
        thread.join()
    assert got == [("submit", ["a"])]  # the late one goes to the next step


def test_the_burst_ends_when_the_gap_passes_and_at_max_s_at_most():
    q = filled(("submit", ["a"]))
    began = time.monotonic()
    assert collect_commands(q, block=True, gap_s=0.0, max_s=10.0) == [("submit", ["a"])]
    assert time.monotonic() - began < 5.0  # not max_s: nothing came in the gap
    q = filled(("submit", ["a"]))
    began = time.monotonic()
    assert collect_commands(q, block=True, gap_s=60.0, max_s=0.05) == [("submit", ["a"])]
    assert time.monotonic() - began < 30.0  # max_s, not the gap


def test_an_idle_engine_does_not_wait_after_an_abort():
    q = filled(("abort", "x"))
    began = time.monotonic()
    assert collect_commands(q, block=True, gap_s=10.0, max_s=10.0) == [("abort", "x")]
    assert time.monotonic() - began < 5.0
