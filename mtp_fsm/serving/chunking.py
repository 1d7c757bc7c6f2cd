"""ChunkingSink: groups each request's frames into vocoder chunks (small first chunk, then
fixed chunks with left context, a final partial chunk on finish)."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable

import attrs
import torch

from ..engine.plan import FinishedRequest, FrameBatch
from ..errors import MtpFsmError
from ..lifecycle import FinishReason
from ..model_api import ModelSpec

# A request ended by the client or by an error gets no more audio: its pending frames
# would be a truncated utterance nobody is waiting for.
_DROP_REASONS = frozenset({FinishReason.ABORT, FinishReason.ERROR})

# How many finished request ids a ChunkingSink remembers (to diagnose late frames / a second finish).
DEFAULT_MAX_CLOSED = 10_000


class FrameOrderError(MtpFsmError):
    """Frames of a request arrived out of order, repeated, or after the request finished."""

    def __init__(self, request_id: str, detail: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id!r}: {detail}")


@attrs.frozen
class AudioChunk:
    """Frames [start_frame, start_frame + len(frames)) of one request, plus up to
    left_context frames just before them for the vocoder's receptive field.

    context_frames, frames: int64 [n, Q] owned tensors. n is 0 only for a final chunk of a
    request whose frames were all emitted already (or that had none, e.g. EOS at once): that
    chunk only marks the end of the stream and carries no audio (has_audio is False).
    """

    request_id: str
    chunk_index: int
    start_frame: int
    context_frames: torch.Tensor
    frames: torch.Tensor
    is_final: bool

    @property
    def end_frame(self) -> int:
        return self.start_frame + int(self.frames.shape[0])

    @property
    def has_audio(self) -> bool:
        """Whether the chunk carries frames (an empty final chunk is an end-of-stream marker)."""
        return int(self.frames.shape[0]) > 0

    def payloads(self, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """A model with a continuous payload (VoxCPM2's patches, for its VAE decoder):
        (context, frames) as [n, *payload shape] tensors in the payload's dtype."""
        if spec.payload is None:
            raise ValueError(f"model {spec.name!r} has no frame payload: its frames are codes")
        first = spec.num_codebooks
        return spec.payload.decode(self.context_frames[:, first:]), spec.payload.decode(self.frames[:, first:])


class _Stream:
    __slots__ = ("next_index", "pending", "history", "chunk_index", "num_codebooks")

    def __init__(self, left_context: int, num_codebooks: int) -> None:
        self.next_index = 0
        self.pending: list[torch.Tensor] = []
        self.history: deque[torch.Tensor] = deque(maxlen=left_context)  # emitted frames, for context
        self.chunk_index = 0
        self.num_codebooks = num_codebooks


class ChunkingSink:
    """A Sink that calls `downstream(chunk)` for each AudioChunk, in order per request.

    Observers (add_observer) see every chunk right after downstream did, e.g. to time
    the first audio of each request; an empty final chunk (has_audio False) is not audio.

    Memory is bounded: a request's stream (pending frames, left context) is dropped when it
    finishes (its final chunk emitted, or nothing more after an abort / error). Only the ids
    of the `max_closed` most recently finished requests are remembered, to name a frame or
    finish that arrives after the end and to drop frames still in flight after an abort.
    """

    def __init__(
        self,
        downstream: Callable[[AudioChunk], None],
        first_chunk: int = 2,
        chunk: int = 25,
        left_context: int = 25,
        *,
        num_codebooks: int | None = None,
        max_closed: int = DEFAULT_MAX_CLOSED,
    ) -> None:
        if not isinstance(first_chunk, int) or first_chunk < 1:
            raise ValueError(f"first_chunk must be an int >= 1, got {first_chunk!r}")
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
        if not isinstance(left_context, int) or left_context < 0:
            raise ValueError(f"left_context must be an int >= 0, got {left_context!r}")
        if type(max_closed) is not int or max_closed < 0:
            raise ValueError(f"max_closed must be an int >= 0, got {max_closed!r}")
        self.downstream = downstream
        self.first_chunk, self.chunk, self.left_context = first_chunk, chunk, left_context
        self.num_codebooks = num_codebooks
        self.max_closed = max_closed
        self._streams: dict[str, _Stream] = {}  # requests with frames and no finish yet
        self._closed: OrderedDict[str, FinishReason] = OrderedDict()  # recently finished, oldest first
        self._observers: list[Callable[[AudioChunk], None]] = []

    def add_observer(self, observer: Callable[[AudioChunk], None]) -> None:
        self._observers.append(observer)

    def on_frames(self, step: int, frames: FrameBatch) -> None:
        indices = frames.frame_index.tolist()
        for i, (rid, index) in enumerate(zip(frames.request_ids, indices)):
            stream = self._stream_for(rid, index, int(frames.codes.shape[1]))
            if stream is None:
                continue
            if index != stream.next_index:
                what = "a repeat" if index < stream.next_index else "a gap"
                raise FrameOrderError(
                    rid, f"frame {index} arrived at step {step} but frame {stream.next_index} was expected ({what})"
                )
            stream.pending.append(frames.codes[i].clone())
            stream.next_index += 1
            if len(stream.pending) == (self.first_chunk if stream.chunk_index == 0 else self.chunk):
                self._emit(rid, stream, is_final=False)

    def on_finished(self, step: int, finished: FinishedRequest) -> None:
        rid, reason = finished.request_id, FinishReason(finished.reason)
        if rid in self._closed:
            raise FrameOrderError(
                rid, f"finished twice (first {self._closed[rid].label}, now {reason.label} at step {step})"
            )
        stream = self._streams.pop(rid, None)
        self._closed[rid] = reason
        while len(self._closed) > self.max_closed:
            self._closed.popitem(last=False)
        if reason in _DROP_REASONS:
            return
        if stream is None:  # finished before its first frame (e.g. EOS at once)
            stream = _Stream(self.left_context, self.num_codebooks or 0)
        self._emit(rid, stream, is_final=True)

    def retained(self) -> dict[str, int]:
        """How many entries are held now: open streams, remembered finished ids."""
        return {"streams": len(self._streams), "closed": len(self._closed)}

    def _stream_for(self, rid: str, index: int, num_codebooks: int) -> _Stream | None:
        stream = self._streams.get(rid)
        if stream is not None:
            return stream
        closed = self._closed.get(rid)
        if closed in _DROP_REASONS:
            return None  # in flight when the client aborted: dropped like the pending frames
        if closed is not None:
            raise FrameOrderError(rid, f"frame {index} arrived after the request finished ({closed.label})")
        stream = self._streams[rid] = _Stream(self.left_context, num_codebooks)
        return stream

    def _emit(self, rid: str, stream: _Stream, *, is_final: bool) -> None:
        q = stream.num_codebooks
        chunk = AudioChunk(
            request_id=rid,
            chunk_index=stream.chunk_index,
            start_frame=stream.next_index - len(stream.pending),
            context_frames=_stack(list(stream.history), q),
            frames=_stack(stream.pending, q),
            is_final=is_final,
        )
        stream.history.extend(stream.pending)
        stream.pending = []
        stream.chunk_index += 1
        self.downstream(chunk)
        for observer in self._observers:
            observer(chunk)


def _stack(rows: list[torch.Tensor], num_codebooks: int) -> torch.Tensor:
    if not rows:
        return torch.zeros(0, num_codebooks, dtype=torch.int64)
    return torch.stack(rows)
