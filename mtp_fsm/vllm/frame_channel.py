"""FramePoller: an API process's side of the per-request frame channel (takes only the frames of requests it owns)."""

from __future__ import annotations

import asyncio
import logging
import pickle
from typing import Any

import torch

from ..engine.plan import FinishedRequest, FrameBatch
from ..lifecycle import FinishReason
from ..serving.sinks import Sink

log = logging.getLogger(__name__)

RPC_METHOD = "mtp_fsm_take_frames_for"
# vLLM's finish reasons -> the engine's, for a request vLLM ended before the worker ever held it.
_VLLM_REASONS = {"stop": FinishReason.EOS, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT,
                 "error": FinishReason.ERROR}


class _Owned:
    __slots__ = ("next_index", "done_after_poll", "vllm_reason", "detail")

    def __init__(self) -> None:
        self.next_index = 0
        self.done_after_poll: int | None = None  # polls sent when vLLM's generate for it had ended
        self.vllm_reason: str | None = None
        self.detail = ""


class FramePoller:
    """Pulls, through `collective_rpc("mtp_fsm_take_frames_for", ids)`, the frames and ends of the requests
    this process opened and nothing else, and hands them to `sink` (JobRouter) in order. So any number
    of API processes share one worker's FrameStore without taking each other's frames (the take-all
    pull did, and lost them).

    A request whose vLLM `generate` has ended and that the worker does not hold in a poll sent after
    that end was never admitted there (vLLM aborted it in its queue): it ends here with vLLM's reason.
    One poll in flight at a time; `interval_s` between polls while any request is open, none when idle.
    """

    def __init__(self, engine_client: Any, sink: Sink, *, interval_s: float = 0.005) -> None:
        self.engine_client, self.sink, self.interval_s = engine_client, sink, interval_s
        self._owned: dict[str, _Owned] = {}
        self._polls = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.failure: str | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="mtp-fsm-frame-poller")

    def open(self, request_id: str) -> None:
        if request_id in self._owned:
            raise ValueError(f"request {request_id!r} is already open in this process's frame channel")
        self._owned[request_id] = _Owned()
        self._wake.set()

    def vllm_done(self, request_id: str, vllm_reason: str | None, detail: str = "") -> None:
        """vLLM's generate for the request has ended (finished, cancelled with its abort sent, or failed:
        reason "error" with vLLM's message as the detail)."""
        owned = self._owned.get(request_id)
        if owned is not None:
            owned.done_after_poll, owned.vllm_reason, owned.detail = self._polls, vllm_reason, detail

    @property
    def open_requests(self) -> int:
        return len(self._owned)

    def health(self) -> str | None:
        if self.failure is not None:
            return self.failure
        if self._task is not None and self._task.done():
            return "the frame poller has stopped"
        return None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:
        while True:
            if not self._owned:
                self._wake.clear()
                await self._wake.wait()
                continue
            ids = list(self._owned)
            self._polls += 1
            poll = self._polls
            try:
                blobs = await self.engine_client.collective_rpc(RPC_METHOD, args=(ids,))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the engine is gone: every open request ends, the server says so
                self.failure = f"frame channel: {type(exc).__name__}: {exc}"
                log.error("%s; ending %d open requests", self.failure, len(self._owned))
                for rid in list(self._owned):
                    self._end(poll, FinishedRequest(rid, FinishReason.ERROR, self._owned[rid].next_index, self.failure))
                return
            # One worker (tensor and pipeline parallel are refused at startup): its answer is the first.
            taken, unknown = pickle.loads(blobs[0])
            for record in taken:
                self._deliver(poll, record)
            for rid in unknown:
                owned = self._owned.get(rid)
                if owned is not None and owned.done_after_poll is not None and owned.done_after_poll < poll:
                    reason = _VLLM_REASONS.get(owned.vllm_reason or "abort", FinishReason.ABORT)
                    self._end(poll, FinishedRequest(rid, reason, owned.next_index,
                                                    f"ended by vLLM ({owned.vllm_reason}) before its worker held it"
                                                    + (f": {owned.detail}" if owned.detail else "")))
            await asyncio.sleep(self.interval_s)

    def _deliver(self, poll: int, record) -> None:
        owned = self._owned.get(record.request_id)
        if owned is None:  # not ours (cannot happen: we asked by id); never hand it to anyone
            log.error("frame channel: got frames of request %r, which this process does not own", record.request_id)
            return
        n = len(record.codes)
        if record.first_index != owned.next_index:
            self._end(poll, FinishedRequest(record.request_id, FinishReason.ERROR, owned.next_index,
                                            f"frame channel: frames from index {record.first_index} arrived after "
                                            f"{owned.next_index}"))
            return
        if n:
            index = torch.arange(record.first_index, record.first_index + n, dtype=torch.int64)
            self.sink.on_frames(poll, FrameBatch((record.request_id,) * n, index, torch.from_numpy(record.codes.copy())))
            owned.next_index += n
        if record.finished is not None:
            self._end(poll, record.finished)

    def _end(self, poll: int, finished: FinishedRequest) -> None:
        self._owned.pop(finished.request_id, None)
        self.sink.on_finished(poll, finished)
