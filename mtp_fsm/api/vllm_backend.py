"""VllmBackend and the endpoint plug-in: the speech routes inside vLLM's own OpenAI server (vLLM schedules)."""

from __future__ import annotations

import asyncio
import logging
import os
from argparse import Namespace
from typing import Any

from ..serving.model_loader import LoadedTalker
from .errors import ApiError
from .inputs import build_request, refusal
from .jobs import JobRouter, SpeechJob
from .limits import Limits
from .metrics import SpeechMetrics
from .routes import STATE_KEY, speech_router
from .server import LIMITS_ENV, LOG_LEVEL_ENV, PLUGIN_NAME, setup_logging
from .service import SpeechService

log = logging.getLogger(__name__)



class VllmBackend:
    """Requests go to vLLM through `engine_client.generate` (so vLLM's scheduler admits, chunks and
    preempts them, and cancelling the generate aborts the request in the engine); their frames come
    back through this process's FramePoller, which takes only the requests this process opened.

    The talker is loaded here too (as TalkerLLM does), only to build and check requests and size their
    prompts: vLLM schedules exactly as many placeholder ids as the talker's prompt has rows."""

    def __init__(self, engine_client: Any, talker: LoadedTalker, decoder, stop_token_id: int) -> None:
        from ..vllm.frame_channel import FramePoller

        self.engine_client, self.talker, self.stop_token_id = engine_client, talker, stop_token_id
        self.talker_name = talker.name
        self.router = JobRouter(decoder, talker.model.spec.frame_width)
        self.poller = FramePoller(engine_client, self.router)
        self._tasks: dict[str, asyncio.Task] = {}
        self._prompt_len: dict[str, int] = {}  # built, not started yet (a refused build leaves nothing)

    @property
    def sample_rate(self) -> int | None:
        return self.router.sample_rate

    def build(self, speech, request_id: str, *, seed: int, max_frames: int):
        request = build_request(self.talker, speech, request_id, max_frames=max_frames, seed=seed)
        try:  # the talker's own input checks here, so a bad voice is a 400 before vLLM queues anything
            self._prompt_len[request_id] = int(self.talker.model.prepare(request.inputs).prompt_embeds.shape[0])
        except Exception as exc:
            raise refusal(request_id, f"inputs rejected by the model: {type(exc).__name__}: {exc}") from None
        return request

    async def start(self, job: SpeechJob) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from ..vllm.request_codec import EXTRA_ARGS_KEY, encode_request

        request, prompt_len = job.request, self._prompt_len.pop(job.request_id)
        why = self.health()
        if why is not None:
            raise ApiError(503, f"the engine is not serving: {why}", reason="engine_down", request_id=job.request_id)
        # DELTA: each engine step's output only (the frames travel the channel; these just mark the end).
        params = SamplingParams(max_tokens=request.max_frames, stop_token_ids=[self.stop_token_id], temperature=1.0,
                                detokenize=False, output_kind=RequestOutputKind.DELTA,
                                extra_args={EXTRA_ARGS_KEY: encode_request(request)})
        self.poller.start()
        self.router.register(job)
        self.poller.open(job.request_id)
        self._tasks[job.request_id] = asyncio.get_running_loop().create_task(
            self._drive(job.request_id, {"prompt_token_ids": [0] * prompt_len}, params))
        job.settle(None)

    async def _drive(self, request_id: str, prompt: dict, params) -> None:
        reason, detail = None, ""
        try:
            async for output in self.engine_client.generate(prompt, params, request_id):
                if output.finished:
                    reason = output.outputs[0].finish_reason if output.outputs else None
        except asyncio.CancelledError:
            reason = "abort"  # vLLM has sent the abort to the engine before re-raising
        except Exception as exc:  # vLLM refused it or its engine died: the request ends with this error
            log.error("speech %s: vLLM generate failed: %s: %s", request_id, type(exc).__name__, exc)
            reason, detail = "error", f"{type(exc).__name__}: {exc}"
        finally:
            self._tasks.pop(request_id, None)
            self.poller.vllm_done(request_id, reason, detail)

    def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def health(self) -> str | None:
        if getattr(self.engine_client, "errored", False):
            return "vLLM's engine has failed"
        return self.poller.health()

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await self.poller.close()
        self.router.close()


class SpeechEndpointPlugin:
    """vLLM's EndpointPlugin (entry point group `vllm.endpoint_plugins`, name mtp_fsm_speech): adds
    POST /v1/audio/speech to vLLM's OpenAI server. Pair it with the `mtp_fsm` general plugin (the
    worker side); VLLM_PLUGINS must name both, or the architecture registration is dropped silently."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        app.include_router(speech_router(health=False, metrics_registry=None))

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        from ..serving.codec import CodecUnavailableError, load_decoder
        from ..vllm.model_dir import TalkerDirConfig

        if engine_client is None:
            raise RuntimeError(f"{PLUGIN_NAME} needs vLLM's engine; it cannot run on the render-only server")
        setup_logging(os.environ.get(LOG_LEVEL_ENV, "info"))  # a spawned API process: vLLM set up only its own
        refuse_layout(engine_client.vllm_config)
        config = TalkerDirConfig.from_hf_config(engine_client.model_config.hf_config)
        talker = config.load_talker()
        decoder = None
        try:
            decoder = load_decoder(config.talker, seed=config.seed)
        except CodecUnavailableError as exc:
            log.warning("%s: serving codes only (response_format codes)", exc)
        backend = VllmBackend(engine_client, talker, decoder, config.stop_token_id)
        backend.router.warm_up(engine_client.vllm_config.scheduler_config.max_num_seqs)
        names = (*(getattr(args, "served_model_name", None) or ()), config.talker, talker.name)
        service = SpeechService(backend, Limits.from_env(os.environ.get(LIMITS_ENV)), SpeechMetrics(), names)
        setattr(state, STATE_KEY, service)


def refuse_layout(vllm_config) -> None:
    """Layouts the per-request channel cannot serve, refused at startup by name: with data parallelism
    vLLM's client returns one engine's RPC result only (the others' frames would never arrive); the
    worker runs one whole engine, so tensor / pipeline parallel ranks would each run a copy."""
    parallel = vllm_config.parallel_config
    for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
        value = getattr(parallel, name, 1) or 1
        if value > 1:
            raise RuntimeError(f"mtp_fsm speech API: {name}={value} is not supported (data parallel: vLLM returns one "
                               "engine's collective_rpc result, so the others' frames would be lost; tensor / pipeline "
                               "parallel: the worker runs one whole talker). Use --api-server-count for more HTTP "
                               "capacity, or one server per engine behind a load balancer")


def plugin() -> SpeechEndpointPlugin:
    """The `vllm.endpoint_plugins` entry point (a zero-argument factory)."""
    return SpeechEndpointPlugin()
