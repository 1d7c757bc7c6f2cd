"""The vLLM V1 worker (`worker_cls`) whose model runner is a LockstepEngine: vLLM schedules, mtp_fsm executes."""

from __future__ import annotations

import pickle

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from ..engine import LockstepEngine
from ..engine.draft_policy import DraftPolicy
from .model_dir import TalkerDirConfig
from .schedule_mapping import ScheduleMapper
from .speculation import check_vllm_config

WORKER_CLS = "mtp_fsm.vllm.worker.FsmWorker"


class FsmWorker(WorkerBase):
    """A vLLM worker that runs no vLLM model: `load_model` builds the talker named in the
    model directory's config.json and a LockstepEngine with one slot per `max_num_seqs`;
    `execute_model` runs each SchedulerOutput as one engine step (ScheduleMapper).

    KV accounting: one FullAttentionSpec per backbone layer with the talker's real KV shape,
    and `determine_available_memory` reports at most the slot layout's KV (every slot holding
    `max_context` positions). A paged talker's pool uses vLLM's block size and holds the blocks
    of its running requests only (`mtp_fsm_kv_blocks`), as vLLM's block tables do; a smaller
    `num_gpu_blocks_override` makes vLLM preempt earlier, and the engine follows.

    Frames leave through `mtp_fsm_take_frames` (pull, via `collective_rpc`): per request,
    in order, exactly once; CB0 also travels as vLLM's sampled token (several per request
    under speculation, whose drafts go back through `take_draft_token_ids`).
    """

    def init_device(self) -> None:
        self.device = torch.device("cpu") if self.device_config.device_type == "cpu" else torch.device(
            "cuda", self.local_rank)
        self.engine: LockstepEngine | None = None
        self.mapper: ScheduleMapper | None = None

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        config = TalkerDirConfig.from_hf_config(self.model_config.hf_config)
        talker = config.load_talker()
        max_slots = self.scheduler_config.max_num_seqs
        check_vllm_config(self.vllm_config, config.speculate)
        # Under speculation vLLM's positions run k + 1 past the context (vllm/speculation.py).
        if self.model_config.max_model_len > talker.model.spec.max_context + config.extra_positions:
            raise ValueError(f"max_model_len {self.model_config.max_model_len} exceeds the talker's KV context "
                             f"{talker.model.spec.max_context} positions per slot")
        # KV in vLLM's page size: one block of a paged talker's pool (models/paged_kv.py) is one vLLM
        # block per layer, taken as positions are written (the engine's steps are not captured here).
        configure = getattr(talker.model, "configure_kv", None)
        if callable(configure):
            configure(block_size=self._block_size(), reserve=False)
        # peak: at the end of a step, before idle slots give theirs back (a slot vLLM preempted in
        # this step frees its blocks only then); held: between steps, what the running requests hold.
        self.kv_peak_blocks = self.kv_held_peak_blocks = 0
        # vLLM owns CUDA-graph capture of its steps: the engine's own decode graphs stay off. Its
        # scheduler plans 1 + k tokens for every decoding request: k drafts every step.
        self.engine = LockstepEngine(talker.model, max_slots, kernels=config.kernels, device=self.device,
                                     decode_graphs="off", speculate=config.speculate,
                                     draft_policy=DraftPolicy(adaptive=False))
        self.mapper = ScheduleMapper(self.engine, config.stop_token_id, type(talker.text_inputs("a")))

    def get_model(self) -> torch.nn.Module:
        module = getattr(self.engine.model, "module", None)
        return module if isinstance(module, torch.nn.Module) else torch.nn.Module()

    # -- KV accounting -------------------------------------------------------------------

    def _block_size(self) -> int:
        return int(self.cache_config.block_size or 16)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        layout = self.engine.model.kv_cache_layout()
        if layout is None:  # a talker without KV: one token-sized page keeps vLLM's arithmetic whole
            return {"talker.kv": FullAttentionSpec(block_size=self._block_size(), num_kv_heads=1, head_size=1,
                                                   dtype=torch.float32)}
        return {f"talker.layers.{i}": FullAttentionSpec(block_size=self._block_size(), num_kv_heads=layout.kv_heads,
                                                        head_size=layout.head_dim, dtype=layout.dtype)
                for i in range(layout.num_layers)}

    def determine_available_memory(self) -> int:
        specs = self.get_kv_cache_spec()
        page_bytes = sum(spec.page_size_bytes for spec in specs.values())
        blocks_per_slot = -(-self.engine.spec.max_context // self._block_size())
        return (self.engine.max_slots * blocks_per_slot + 1) * page_bytes  # +1: vLLM's null block

    def initialize_from_config(self, kv_cache_config) -> None:
        self.kv_cache_config = kv_cache_config  # the engine's slot table already holds the KV

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(0.0, 0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    # -- stepping ------------------------------------------------------------------------

    def execute_model(self, scheduler_output) -> ModelRunnerOutput:
        mapped = self.mapper.step(scheduler_output)
        self._release_idle_kv()
        req_ids = list(scheduler_output.num_scheduled_tokens)
        if not req_ids:
            return EMPTY_MODEL_RUNNER_OUTPUT
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                                 sampled_token_ids=[mapped.sampled.get(rid, []) for rid in req_ids])

    def _release_idle_kv(self) -> None:
        """A paged talker gets a slot's blocks back when the slot is next admitted; here they go back
        as soon as the slot is free (its request ended or was preempted), as vLLM frees its blocks,
        so the blocks held are those of the running requests: ceil(positions / block_size) each."""
        pool = getattr(self.engine.model, "kv_pool", None)
        if pool is None:
            return
        self.kv_peak_blocks = max(self.kv_peak_blocks, pool.blocks_in_use)
        in_use = self.engine.ledger.allocator.in_use()
        idle = [s for s in range(self.engine.max_slots) if s not in in_use and pool.holds(s)]
        if idle:
            self.engine.model.reset_slots(torch.tensor(idle, dtype=torch.int64, device=self.device))
        self.kv_held_peak_blocks = max(self.kv_held_peak_blocks, pool.blocks_in_use)

    def mtp_fsm_kv_blocks(self) -> dict:
        """The talker's KV in vLLM's terms: block size, blocks held now, their peaks (see load_model),
        and vLLM's own block count (None for a talker without a paged pool)."""
        pool = getattr(self.engine.model, "kv_pool", None)
        vllm_blocks = getattr(getattr(self, "kv_cache_config", None), "num_blocks", None)
        if pool is None:
            return {"block_size": None, "in_use": None, "peak": None, "held_peak": None, "vllm_num_blocks": vllm_blocks}
        return {"block_size": pool.block_size, "in_use": pool.blocks_in_use, "peak": self.kv_peak_blocks,
                "held_peak": self.kv_held_peak_blocks, "vllm_num_blocks": vllm_blocks}

    def take_draft_token_ids(self):
        """The drafts of the requests the last step left decoding (vLLM plans them as the next
        step's speculative tokens); None without speculation."""
        return None if self.mapper is None or self.mapper.drafts is None else self.mapper.drafts.take()

    def mtp_fsm_speculation(self) -> bytes:
        """The engine's SpeculationStats (pickled; None without speculation)."""
        return pickle.dumps(self.engine.speculation)

    # -- the frame channel (collective_rpc) -----------------------------------------------

    # Results are pickled here: vLLM's multiprocess executor sends RPC results as msgpack,
    # which would flatten attrs objects and numpy arrays into dicts and lists.
    def mtp_fsm_take_frames(self) -> bytes:
        """Frames and finishes not pulled yet (list[TakenFrames], pickled), then forgotten."""
        return pickle.dumps(self.mapper.frames.take())

    def mtp_fsm_take_frames_for(self, request_ids: list[str]) -> bytes:
        """The per-request channel: frames and finishes of `request_ids` only (pickled (list[TakenFrames],
        the ids the store does not hold: never admitted here, or already taken to their end)). Each API
        process asks for the requests it owns, so no process takes another's frames."""
        taken = self.mapper.frames.take(request_ids)
        unknown = [rid for rid in request_ids if not self.mapper.frames.is_open(rid)
                   and not any(t.request_id == rid for t in taken)]
        return pickle.dumps((taken, unknown))

    def mtp_fsm_metrics(self) -> bytes:
        """The engine-side ServingMetrics (pickled): steps, states, frames, first-frame latency
        measured from admission in the worker (the client's queueing in vLLM is not in it)."""
        return pickle.dumps(self.mapper.metrics)

    def mtp_fsm_free_slots(self) -> int:
        return self.engine.num_free_slots

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close()
