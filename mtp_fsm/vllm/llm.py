"""TalkerLLM: a vLLM `LLM` whose worker runs a talker through mtp_fsm; submit NewRequests, get frames."""

from __future__ import annotations

import logging
import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from ..engine.plan import FinishedRequest, Frame, Generation, NewRequest
from ..errors import AdmissionError
from ..lifecycle import FinishReason, lifecycle_for
from ..serving.metrics import ServingMetrics, ServingSummary
from .frame_store import TakenFrames
from .model_dir import TalkerDirConfig, stop_token_id, write_model_dir
from .request_codec import EXTRA_ARGS_KEY, encode_request

log = logging.getLogger(__name__)

# vLLM's finish reasons -> the engine's, for requests vLLM ended itself.
_VLLM_REASONS = {"stop": FinishReason.EOS, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
# vLLM 0.32 makes its internal request id `{external id}-{8 random characters}` (InputProcessor).
_INTERNAL_ID = re.compile(r"^(?P<external>.+)-[0-9a-f]{8}$")
_ENDED_MEMORY = 4096  # ids of ended requests whose late worker records are dropped quietly


class FrameChannelError(RuntimeError):
    """The frames pulled from the worker disagree with the CB0 tokens vLLM delivered (the
    detail of that one request's error finish: the channel goes on for the others)."""


class TalkerLLM:
    """vLLM's engine core and scheduler drive mtp_fsm's LockstepEngine (worker_cls FsmWorker).

    talker: a short name of `models/` (tiny seeded demo talker) or a factory import string;
    talker_kwargs: call the factory with these instead of `seed` (e.g. a checkpoint loader
    and its directory). The frontend builds its own copy of the talker only to validate
    requests and size their prompts (vLLM schedules exactly P placeholder ids).

    multiprocessing=False runs vLLM's engine core and the worker in this process (fast to
    start, 2 torch threads here); True is vLLM's default layout (engine core and worker in
    spawned processes: callers need an `if __name__ == "__main__":` guard).
    Extra keyword arguments go to `vllm.LLM` (e.g. `num_gpu_blocks_override` for a KV budget,
    `max_num_batched_tokens` for the per-step token budget).

    speculate=k: speculative decoding with the talker's drafter, vLLM planning each decoding
    request's 1 + k verify tokens (vllm/speculation.py): vLLM gets a speculative_config,
    max_model_len = the talker's context + k + 1, and a token budget that holds every running
    row whole (max_num_seqs x max_model_len at least). Frames are the embedded engine's.
    """

    def __init__(self, talker: str = "qwen3_tts", *, talker_kwargs: dict[str, Any] | None = None, seed: int = 0,
                 max_num_seqs: int = 16, max_model_len: int | None = None, kernels: str = "torch",
                 multiprocessing: bool = False, model_dir: str | Path | None = None, speculate: int = 0,
                 **llm_kwargs: Any) -> None:
        self.config = TalkerDirConfig(talker, talker_kwargs, seed, kernels, speculate=speculate)
        self.talker = self.config.load_talker()
        spec = self.talker.model.spec
        self.speculate = speculate
        if speculate:
            max_model_len = max_model_len or spec.max_context + self.config.extra_positions
            llm_kwargs = with_speculation(llm_kwargs, speculate, max_num_seqs, max_model_len)
        self.stop_token_id = stop_token_id(spec)
        self._stop_frame_published = lifecycle_for(spec.lifecycle).publishes_stop_frame
        self._tmp = None
        if model_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="mtp_fsm_vllm_")
            model_dir = self._tmp.name
        self.model_dir = write_model_dir(model_dir, self.config, self.talker.model)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
        from vllm import LLM

        from .worker import WORKER_CLS

        self._running: dict[str, Generation] = {}
        self._max_frames: dict[str, int] = {}
        self._aborting: dict[str, Generation] = {}
        self._ended: dict[str, None] = {}  # recently ended ids, oldest first
        self.dropped_records = 0  # worker records for ids this frontend never ran (logged)
        self._idle_steps = 0
        self.llm = LLM(
            model=str(self.model_dir), worker_cls=WORKER_CLS, skip_tokenizer_init=True,
            enable_prefix_caching=False,  # the engine keeps no shared prefix KV: every prompt is computed
            max_num_seqs=max_num_seqs, max_model_len=max_model_len or spec.max_context,
            dtype=spec.dtype, **llm_kwargs,
        )

    # -- requests ------------------------------------------------------------------------

    def prompt_length(self, request: NewRequest) -> int:
        """The talker's prompt rows for this request (AdmissionError when the talker refuses it)."""
        try:
            return int(self.talker.model.prepare(request.inputs).prompt_embeds.shape[0])
        except Exception as exc:  # the model's own input checks
            raise AdmissionError(request.request_id, f"the talker refuses its inputs: {exc}") from exc

    def vllm_request(self, request: NewRequest) -> tuple[dict, Any]:
        """(prompt, vllm.SamplingParams) for one request: P placeholder ids, max_tokens =
        max_frames, the stop id, and the request's own fields in extra_args. vLLM's sampler
        options stay neutral: the engine samples (its own penalty, min_frames)."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        prompt = {"prompt_token_ids": [0] * self.prompt_length(request)}
        params = VllmSamplingParams(max_tokens=request.max_frames, stop_token_ids=[self.stop_token_id],
                                    temperature=1.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
                                    extra_args={EXTRA_ARGS_KEY: encode_request(request)})
        return prompt, params

    def submit(self, request: NewRequest) -> None:
        """Queue a request with vLLM (AdmissionError, nothing queued, when the talker refuses it)."""
        if request.request_id in self._running:
            raise AdmissionError(request.request_id, "a request with this id is already running", "running")
        prompt, params = self.vllm_request(request)
        self.llm.llm_engine.add_request(request.request_id, prompt, params)
        self._running[request.request_id] = Generation(request.request_id)
        self._max_frames[request.request_id] = request.max_frames

    def abort(self, request_id: str) -> None:
        """End a request through vLLM; its worker aborts it in the engine at the next step,
        and a later `step()` returns it (finish reason abort, the frames published before)."""
        if request_id in self._running:
            self._aborting[request_id] = self._running.pop(request_id)
            self.llm.llm_engine.abort_request([request_id])

    @property
    def has_unfinished(self) -> bool:
        return bool(self._running or self._aborting)

    def step(self) -> list[Generation]:
        """One vLLM engine step; pulls the frames published since the last pull into the
        running requests (`running(rid).frames`) and returns the requests that ended."""
        outputs = self.llm.llm_engine.step()
        self._collect(self.take_frames())
        # vLLM reports nothing for an aborted request: it has ended once the worker says so.
        ended = [self._aborting.pop(rid) for rid, g in list(self._aborting.items()) if g.finished is not None]
        if self._aborting and not self.llm.llm_engine.has_unfinished_requests():
            self._idle_steps += 1
            if self._idle_steps > 2:  # vLLM dropped them before any step reached the worker
                for rid in list(self._aborting):
                    generation = self._aborting.pop(rid)
                    generation.finished = FinishedRequest(rid, FinishReason.ABORT, len(generation.frames),
                                                          "aborted before the worker admitted it")
                    ended.append(generation)
        else:
            self._idle_steps = 0
        for output in outputs:
            if output.finished and output.request_id in self._running:
                generation = self._running.pop(output.request_id)
                self._check(generation, output)
                ended.append(generation)
        for generation in ended:
            self._remember_ended(generation.request_id)
        return ended

    def _remember_ended(self, request_id: str) -> None:
        self._max_frames.pop(request_id, None)
        self._ended[request_id] = None
        while len(self._ended) > _ENDED_MEMORY:
            del self._ended[next(iter(self._ended))]

    def running(self, request_id: str) -> Generation:
        return self._running[request_id]

    def generate(self, requests: Sequence[NewRequest]) -> dict[str, Generation]:
        """Run requests to their end under vLLM's scheduler; frames and finish per request id."""
        for request in requests:
            self.submit(request)
        results: dict[str, Generation] = {}
        while self.has_unfinished:
            for generation in self.step():
                results[generation.request_id] = generation
        return {r.request_id: results[r.request_id] for r in requests}

    # -- the frame channel ---------------------------------------------------------------

    def take_frames(self) -> list[TakenFrames]:
        """Frames (and finishes) the worker published since the last pull."""
        return [taken for blob in self.llm.collective_rpc("mtp_fsm_take_frames") for taken in pickle.loads(blob)]

    def metrics(self) -> ServingMetrics:
        """The worker's serving metrics (the embedded loop's kind: steps, states, latencies)."""
        return pickle.loads(self.llm.collective_rpc("mtp_fsm_metrics")[0])

    def summary(self) -> ServingSummary:
        """The worker's serving summary (same table as the embedded loop's)."""
        return self.metrics().summary()

    def _owner(self, request_id: str) -> Generation | None:
        generation = self._running.get(request_id) or self._aborting.get(request_id)
        match = _INTERNAL_ID.match(request_id) if generation is None else None
        if match is not None:  # a record the worker could only key by vLLM's internal id
            generation = self._running.get(match["external"]) or self._aborting.get(match["external"])
        return generation

    def _collect(self, taken_frames: list[TakenFrames]) -> None:
        """Each record to the request it belongs to. A record for a request that already ended
        here (vLLM ended it first, e.g. at max_model_len; the worker then aborts it) or that
        this frontend never ran is dropped (logged): one request never stops the others'."""
        for taken in taken_frames:
            generation = self._owner(taken.request_id)
            if generation is None:
                if taken.request_id not in self._ended or len(taken.codes):
                    self.dropped_records += 1
                    log.warning("frame channel: dropped %d frames%s for request %r, which is not running here",
                                len(taken.codes), " and its finish" if taken.finished else "", taken.request_id)
                continue
            if taken.first_index != len(generation.frames):
                generation.finished = FinishedRequest(
                    generation.request_id, FinishReason.ERROR, len(generation.frames),
                    f"frame channel: frames from index {taken.first_index} arrived after {len(generation.frames)}")
                continue
            for offset, codes in enumerate(taken.codes):
                generation.frames.append(Frame(taken.request_id, taken.first_index + offset,
                                               torch.from_numpy(codes.copy())))
            if taken.finished is not None:
                generation.finished = taken.finished

    def _check(self, generation: Generation, output: Any) -> None:
        """CB0 travels twice (vLLM's token ids, the pulled frames): they must agree."""
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        cb0 = [int(f.codes[0]) for f in generation.frames]
        reason = None if generation.finished is None else generation.finished.reason
        if reason is FinishReason.EOS and self._stop_frame_published and cb0:
            cb0 = cb0[:-1]  # the ending step published the last frame: its token is the stop id
        # Speculative: an engine LENGTH end short of max_frames is the context's, which vLLM
        # (its max_model_len past the context) learns from the stop id too.
        context_end = (self.speculate and reason is FinishReason.LENGTH
                       and len(generation.frames) < self._max_frames.get(generation.request_id, len(generation.frames)))
        stopped = reason in (FinishReason.EOS, FinishReason.ERROR) or context_end
        expected = cb0 + ([self.stop_token_id] if stopped else [])
        if generation.finished is None and completion.finish_reason == "length":
            expected = cb0  # vLLM's own cap (max_tokens or max_model_len) ended it before the engine did
        if tokens != expected:
            error = FrameChannelError(f"request {generation.request_id!r}: vLLM delivered CB0 tokens {tokens[:8]}... "
                                      f"({len(tokens)}) but the worker's frames give {expected[:8]}... "
                                      f"({len(expected)})")
            log.error("%s", error)
            generation.finished = FinishedRequest(generation.request_id, FinishReason.ERROR, len(generation.frames),
                                                  str(error))
            return
        if generation.finished is None:  # vLLM ended it (abort, a vLLM-side cap) before the engine did
            reason = _VLLM_REASONS.get(completion.finish_reason, FinishReason.ABORT)
            generation.finished = FinishedRequest(generation.request_id, reason, len(generation.frames),
                                                  f"ended by vLLM ({completion.finish_reason})")

    def speculation(self):
        """The worker engine's SpeculationStats (drafts proposed / accepted); None without speculation."""
        return pickle.loads(self.llm.collective_rpc("mtp_fsm_speculation")[0])

    def close(self) -> None:
        """Shut vLLM down and delete the temporary model directory."""
        engine = getattr(self.llm, "llm_engine", None)
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "TalkerLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def with_speculation(llm_kwargs: dict, k: int, max_num_seqs: int, max_model_len: int) -> dict:
    """vLLM's keyword arguments for k drafts a row: the speculative_config, and budgets that never
    cut a verify row short (the engine's rows are exactly 1 + k tokens wide)."""
    from .speculation import speculative_config

    out = {**llm_kwargs, "speculative_config": llm_kwargs.get("speculative_config") or speculative_config(k)}
    out["max_num_batched_tokens"] = max(int(out.get("max_num_batched_tokens") or 0), max_num_seqs * max_model_len)
    threshold = int(out.get("long_prefill_token_threshold") or 0)
    if 0 < threshold < 1 + k:
        raise ValueError(f"long_prefill_token_threshold {threshold} would cut a verify row of {1 + k} tokens short")
    return out


__all__ = ["FrameChannelError", "TalkerLLM"]
