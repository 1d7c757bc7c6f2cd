"""RequestQueue: FCFS order, withdrawal, duplicate ids."""

import pytest

from mtp_fsm.errors import DuplicateRequestError
from mtp_fsm.serving import RequestQueue
from serving_util import request


def test_fcfs_peek_pop_len():
    q = RequestQueue()
    for rid in "abc":
        q.submit(request(rid))
    assert len(q) == 3 and q.peek().request_id == "a"
    assert [q.pop().request_id for _ in range(3)] == ["a", "b", "c"]
    assert q.peek() is None and len(q) == 0
    with pytest.raises(IndexError):
        q.pop()


def test_abort_of_queued_request_keeps_order():
    q = RequestQueue()
    for rid in "abc":
        q.submit(request(rid))
    assert q.abort("b").request_id == "b"
    assert q.abort("b") is None and q.abort("zzz") is None
    assert [r.request_id for r in q] == ["a", "c"] and "b" not in q and q.position("c") == 1


def test_duplicate_id_rejected_with_clear_error():
    q = RequestQueue()
    q.submit(request("a"))
    with pytest.raises(DuplicateRequestError, match=r"'a'.*queued.*position 0"):
        q.submit(request("a"))
    assert len(q) == 1
