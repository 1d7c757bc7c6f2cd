"""EmbeddedBackend: the built-in ServingLoop stepping on its own thread behind the speech API (no vLLM)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Callable

from ..engine import LockstepEngine
from ..engine.plan import FinishedRequest, FrameBatch
from ..errors import MtpFsmError
from ..lifecycle import FinishReason
from ..serving.codec import CodecDecoder
from ..serving.model_loader import LoadedTalker
from ..serving.runner import ServingLoop
from .errors import ApiError
from .inputs import build_request, refusal
from .jobs import EndEvent, JobRouter, SpeechJob

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long the idle engine thread sleeps on its command queue before looking again
# The most a step waits for the first audio of requests whose first frame it published (JobRouter.wait_first_audio).
FIRST_AUDIO_WAIT_S = 0.1
# The event loop hands requests over once per iteration of its own, all those it parsed in it ("submit",
# [jobs]): one wake-up of the engine's thread per iteration, not one per request (each wake-up is a GIL
# hand-off, and at 32 concurrent they slowed the loop's parsing of the rest of the burst). An idle engine
# that gets requests waits for the rest of their burst before its first step, so requests that arrive
# together share that step instead of the later ones waiting a whole step for the next boundary: while the
# event loop holds requests it has not handed over yet (it is parsing the burst), then COALESCE_GAP_S more
# for requests whose bytes reach the server later; COALESCE_MAX_S from the first at most. The gap covers
# the loop's work on a request before it reaches the backend (1-3 ms a request on a loaded 2-core host:
# with 2 ms, a burst of 32 was admitted as 1 + 14 + 17 over three steps).
COALESCE_GAP_S = 0.005
COALESCE_MAX_S = 0.05


def collect_commands(commands: queue.SimpleQueue, *, block: bool, idle_wait_s: float = _IDLE_WAIT_S,
                     gap_s: float = COALESCE_GAP_S, max_s: float = COALESCE_MAX_S,
                     in_hand: Callable[[], bool] = lambda: False) -> list[tuple[str, object]]:
    """The commands to run now, in order. Not blocking (a busy engine, between steps): those waiting.
    Blocking (an idle engine): the next to come (up to `idle_wait_s`), and when that is a hand-over of
    requests ("submit"), the rest of its burst: until `gap_s` passes with no command while `in_hand()`
    (the event loop holds requests not handed over yet) is false; `max_s` from the first at most. Why an
    idle engine waits at all: admission work (the model's prompt preparation) would hold the GIL while the
    event loop still parses the burst's other requests, and those would wait a whole step."""
    try:
        taken = [commands.get(timeout=idle_wait_s) if block else commands.get_nowait()]
    except queue.Empty:
        return []
    deadline = time.monotonic() + max_s
    bursting = block and taken[0][0] == "submit"
    while True:
        wait = min(gap_s, deadline - time.monotonic()) if bursting else 0.0
        try:
            command = commands.get(timeout=wait) if wait > 0 else commands.get_nowait()
        except queue.Empty:
            if bursting and wait > 0 and in_hand():
                continue  # the loop is still parsing the burst: its hand-over is coming
            return taken
        taken.append(command)
        bursting = bursting or (block and command[0] == "submit")


class _Admission:
    """The engine-side sink that catches the rejection of the request being submitted (ServingLoop reports
    a refused request as finished with reason error before `submit` returns False)."""

    def __init__(self) -> None:
        self.submitting: str | None = None
        self.detail: str | None = None

    def on_frames(self, step: int, frames: FrameBatch) -> None:
        pass

    def on_finished(self, step: int, finished: FinishedRequest) -> None:
        if finished.request_id == self.submitting:
            self.detail = finished.detail or "refused"


class EmbeddedBackend:
    """One LockstepEngine under the built-in policy, stepped by one thread that owns it (and the
    ServingLoop): the event loop hands it submissions and aborts through a queue, and gets frames,
    PCM and ends back through each job's queue (JobRouter). Nothing else touches the engine.

    A request the talker refuses at admission (an unknown speaker, ...) is refused alone with 400; a
    model fault ends only the requests of the failing step or row (the engine's guarantee), each with
    a 500; an engine invariant failure stops the thread, fails every request in flight and turns
    /health to 503 (a broken engine must not keep serving wrong frames)."""

    def __init__(self, talker: LoadedTalker, engine: LockstepEngine, decoder: CodecDecoder | None, *,
                 audio_threaded: bool = True, first_audio_wait_s: float = FIRST_AUDIO_WAIT_S,
                 coalesce_gap_s: float = COALESCE_GAP_S) -> None:
        self.talker, self.engine = talker, engine
        self.coalesce_gap_s = coalesce_gap_s
        self.first_audio_wait_s = first_audio_wait_s  # 0: never wait (throughput over first audio)
        self.talker_name = talker.name
        self.router = JobRouter(decoder, engine.spec.frame_width, threaded=audio_threaded)
        if decoder is not None:
            log.info("decoder warmed up for 1-%d first chunks in %.1f s", engine.max_slots,
                     self.router.warm_up(engine.max_slots))
        self._admission = _Admission()
        # The admission sink sits before the router: a refused request's report is caught first.
        self.loop = ServingLoop(engine, sinks=(self._admission, self.router))
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handing: list[SpeechJob] = []  # (the event loop's thread) started in this iteration of the loop
        self._failure: str | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mtp-fsm-engine", daemon=True)
        self._thread.start()

    @property
    def sample_rate(self) -> int | None:
        return self.router.sample_rate

    @property
    def metrics(self):
        """The engine-side ServingMetrics (first frame from the engine's submit, and from the moment its thread
        took the request: first_frame_from_received_ms; read from another thread: approximate)."""
        return self.loop.metrics

    def build(self, speech, request_id: str, *, seed: int, max_frames: int):
        return build_request(self.talker, speech, request_id, max_frames=max_frames, seed=seed)

    # -- the event loop's side -----------------------------------------------------------

    async def start(self, job: SpeechJob) -> None:
        """Queue the job for admission; job.accepted says whether the engine took it."""
        why = self.health()
        if why is not None:
            raise ApiError(503, f"the engine is not serving: {why}", reason="engine_down", request_id=job.request_id)
        self.router.register(job)
        self._handing.append(job)
        # call_soon: after the other requests this iteration of the loop parses; the first call hands them
        # all over, the others find nothing (one call each, so a loop stopped before running one loses none).
        asyncio.get_running_loop().call_soon(self._hand_over)

    def _hand_over(self) -> None:
        jobs, self._handing = self._handing, []
        if jobs:
            self._commands.put(("submit", jobs))

    def abort(self, request_id: str) -> None:
        self._hand_over()  # (the event loop's thread) a request started in this iteration is submitted first
        self._commands.put(("abort", request_id))

    def health(self) -> str | None:
        """None when serving; else why not."""
        if self._failure is not None:
            return self._failure
        if not self._thread.is_alive():
            return "the engine thread has stopped"
        return None

    def close(self) -> None:
        """Abort what is in flight, stop the thread, close the decoder stage."""
        if self._thread.is_alive():
            self._commands.put(("stop", None))
            self._thread.join()
        self.router.close()
        self.engine.close()

    # -- the engine's thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain(block=self.loop.idle)
                if self._stopped.is_set():
                    break
                if not self.loop.idle:
                    if self.loop.step() is None:
                        self._drain(block=True)  # nothing runnable now (a request waits for input)
                    elif self.first_audio_wait_s:
                        self.router.wait_first_audio(self.first_audio_wait_s)  # first audio before the next step
        except Exception as exc:  # an engine invariant broke: nothing it says can be trusted now
            self._failure = f"{type(exc).__name__}: {exc}"
            log.exception("engine thread failed; every request in flight fails")
            self._fail_all(self._failure)
            return
        self._abort_all("server shutdown")

    def _drain(self, *, block: bool) -> None:
        """Run the commands waiting (or, idle, the next ones to come: a burst, `collect_commands`)."""
        commands = collect_commands(self._commands, block=block, gap_s=self.coalesce_gap_s,
                                    in_hand=lambda: bool(self._handing))
        if not commands:
            return
        taken = self.loop.clock()  # the engine has the whole batch from here (its first-frame clock starts)
        for kind, arg in commands:
            if kind == "submit":
                for job in arg:
                    self._submit(job, taken)
            elif kind == "abort":
                self.loop.abort(arg)
            elif kind == "stop":
                self._stopped.set()
                return

    def _submit(self, job: SpeechJob, taken: float) -> None:
        self._admission.submitting, self._admission.detail = job.request_id, None
        try:
            accepted = self.loop.submit(job.request, received=taken)
        except MtpFsmError as exc:  # a duplicate id: refused by name, nothing queued
            accepted, self._admission.detail = False, str(exc)
        finally:
            self._admission.submitting = None
        if accepted:
            job.settle(None)
        else:
            self.router.forget(job.request_id)
            job.settle(refusal(job.request_id, self._admission.detail or "refused"))

    def _abort_all(self, why: str) -> None:
        for rid in list(self.engine.requests()):
            self.loop.abort(rid)
        deadline = time.monotonic() + 5.0
        while not self.loop.idle and time.monotonic() < deadline:  # let the aborts be reported
            if self.loop.step() is None:
                break
        self._fail_all(why)

    def _fail_all(self, why: str) -> None:
        for rid in self.router.ids():
            job = self.router.job(rid)
            if job is not None:
                job.settle(ApiError(503, f"request {rid!r}: {why}", reason="engine_down", request_id=rid))
                job.push(EndEvent(FinishedRequest(rid, FinishReason.ABORT, 0, why)))
            self.router.forget(rid)
