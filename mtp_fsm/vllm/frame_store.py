"""Frames held in the worker until the caller pulls them: per request, in order, exactly once."""

from __future__ import annotations

import attrs
import numpy as np

from ..engine.plan import FinishedRequest, FrameBatch


@attrs.frozen
class TakenFrames:
    """What one pull returns for one request: frames `first_index ..` in order, and how the
    request ended once it has (None while it runs). Plain numpy so it pickles across vLLM's
    process boundaries cheaply."""

    request_id: str  # the caller's id (NewRequest.request_id as submitted)
    first_index: int
    codes: np.ndarray  # int64 [n, Q]
    finished: FinishedRequest | None = None


class FrameStore:
    """Frames published by the engine, keyed by the caller's request id, until `take()`.

    A request's entry is dropped once its finish has been taken, so memory is bounded by
    what callers have not pulled yet."""

    def __init__(self, num_codebooks: int) -> None:
        self.num_codebooks = num_codebooks
        self._frames: dict[str, list[np.ndarray]] = {}
        self._next_index: dict[str, int] = {}  # index of the first frame not yet taken
        self._finished: dict[str, FinishedRequest] = {}

    def open(self, request_id: str) -> None:
        if request_id in self._next_index:
            raise ValueError(f"request {request_id!r} is already in the frame store (ids must be unique while "
                             "their frames or finish are not taken)")
        self._frames[request_id], self._next_index[request_id] = [], 0

    def is_open(self, request_id: str) -> bool:
        return request_id in self._next_index

    def add_frames(self, batch: FrameBatch, caller_id: dict[str, str]) -> None:
        """A step's frames; `caller_id` maps the engine's (vLLM's internal) ids to the caller's."""
        codes = batch.codes.numpy()
        for row, rid in enumerate(batch.request_ids):
            cid = caller_id[rid]
            pending = self._frames[cid]
            expected = self._next_index[cid] + len(pending)
            if int(batch.frame_index[row]) != expected:
                raise AssertionError(f"request {cid!r}: frame {int(batch.frame_index[row])} published, {expected} "
                                     "expected (frames must arrive in order, once)")
            pending.append(codes[row])

    def finish(self, caller: str, finished: FinishedRequest) -> None:
        self._finished.setdefault(caller, attrs.evolve(finished, request_id=caller))

    def take(self, request_ids=None) -> list[TakenFrames]:
        """Every request's frames not taken yet (and its finish, if it ended); clears them.
        request_ids: only these requests' (the per-request channel: an API process takes only the
        requests it owns, so several processes never take each other's frames)."""
        out = []
        for cid in list(self._next_index) if request_ids is None else [r for r in request_ids if r in self._next_index]:
            pending, finished = self._frames[cid], self._finished.get(cid)
            if not pending and finished is None:
                continue
            first = self._next_index[cid]
            codes = np.stack(pending) if pending else np.zeros((0, self.num_codebooks), dtype=np.int64)
            out.append(TakenFrames(cid, first, codes, finished))
            if finished is not None:
                del self._frames[cid], self._next_index[cid], self._finished[cid]
            else:
                self._next_index[cid], self._frames[cid] = first + len(pending), []
        return out
