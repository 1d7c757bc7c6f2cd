"""Sinks: where a serving loop hands published frames and finished requests (protocol + basics)."""

from __future__ import annotations

import json
import os
from typing import Callable, Protocol, runtime_checkable

from ..engine.plan import FinishedRequest, FrameBatch
from ..lifecycle import FinishReason


@runtime_checkable
class Sink(Protocol):
    """Receives each step's frames (request-major, in frame order per request) and each
    request's end. Frames are owned copies; a sink that keeps them past the call should
    still copy, since another sink in the same loop sees the same objects."""

    def on_frames(self, step: int, frames: FrameBatch) -> None: ...

    def on_finished(self, step: int, finished: FinishedRequest) -> None: ...


class CallbackSink:
    """Adapts plain callables to the Sink protocol; either callback may be omitted."""

    def __init__(
        self,
        on_frames: Callable[[int, FrameBatch], None] | None = None,
        on_finished: Callable[[int, FinishedRequest], None] | None = None,
    ) -> None:
        self._on_frames, self._on_finished = on_frames, on_finished

    def on_frames(self, step: int, frames: FrameBatch) -> None:
        if self._on_frames is not None:
            self._on_frames(step, frames)

    def on_finished(self, step: int, finished: FinishedRequest) -> None:
        if self._on_finished is not None:
            self._on_finished(step, finished)


class InMemorySink:
    """Keeps every frame as plain Python ints: frames[rid] = [(frame_index, codes), ...]."""

    def __init__(self) -> None:
        self.frames: dict[str, list[tuple[int, list[int]]]] = {}
        self.finished: dict[str, FinishedRequest] = {}

    def on_frames(self, step: int, frames: FrameBatch) -> None:
        # tolist() builds fresh Python objects: nothing here aliases the batch's tensors.
        indices, codes = frames.frame_index.tolist(), frames.codes.tolist()
        for rid, index, row in zip(frames.request_ids, indices, codes):
            self.frames.setdefault(rid, []).append((index, row))

    def on_finished(self, step: int, finished: FinishedRequest) -> None:
        self.finished[finished.request_id] = finished

    def reasons(self) -> dict[str, FinishReason]:
        return {rid: f.reason for rid, f in self.finished.items()}

    def codes(self, request_id: str) -> list[list[int]]:
        """The request's frames' codes in arrival order (empty if it produced none)."""
        return [row for _, row in self.frames.get(request_id, [])]


class JsonlSink:
    """One JSON object per frame and per finish, flushed at every call so a reader
    tailing the file (or a crash) never sees a half-written step."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._file = open(self.path, "w", encoding="utf-8")

    def on_frames(self, step: int, frames: FrameBatch) -> None:
        indices, codes = frames.frame_index.tolist(), frames.codes.tolist()
        for rid, index, row in zip(frames.request_ids, indices, codes):
            record = {"type": "frame", "step": step, "request_id": rid, "frame_index": index, "codes": row}
            self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def on_finished(self, step: int, finished: FinishedRequest) -> None:
        record = {
            "type": "finished", "step": step, "request_id": finished.request_id,
            "reason": FinishReason(finished.reason).label, "num_frames": finished.num_frames,
        }
        if finished.detail:
            record["detail"] = finished.detail
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "JsonlSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
