"""Speculative decoding under vLLM's scheduler: vLLM plans 1 + k tokens per decoding request from the drafts the worker hands back, the engine verifies them.

How vLLM 0.32 (V1, synchronous scheduling) does it, and where mtp_fsm plugs in:
- a `speculative_config` makes the engine core ask the executor for drafts after every step
  (`EngineCore.post_step` -> `take_draft_token_ids()` -> `Scheduler.update_draft_token_ids`);
  method "ngram" loads no draft model, and its proposer lives in vLLM's GPU model runner,
  which the FsmWorker replaces: the engine's drafter (`TalkerModel.draft`) proposes instead;
- the scheduler then schedules each running request `1 + len(spec_token_ids)` tokens
  (`scheduled_spec_decode_tokens` in the SchedulerOutput): exactly the engine's verify row;
- the worker returns every frame the row published (`sampled_token_ids`, a list per request),
  and vLLM rolls back what was not accepted (`num_computed_tokens -= rejected`), as the
  engine's num_computed stops at its newest token.
The engine needs every decoding request's row to be k + 1 wide, so vLLM must never cut one
short: its token budget holds every running row whole (TalkerLLM sizes it) and its
max_model_len is the talker's context + k + 1 (the engine ends a request whose next input no
longer fits, and the worker then returns the stop id so vLLM stops it too).
"""

from __future__ import annotations

from vllm.v1.outputs import DraftTokenIds

from ..engine import LockstepEngine
from ..engine.speculation import DRAFT_TOKENS
from ..lifecycle import State


def speculative_config(k: int) -> dict:
    """vLLM's speculative_config for k drafts the worker supplies: "ngram" loads no draft model
    and its proposer (in the GPU model runner the FsmWorker replaces) never runs."""
    return {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_max": 1, "prompt_lookup_min": 1}


def check_vllm_config(vllm_config, k: int) -> None:
    """Refuse a worker whose vLLM was not told to plan k drafts (or plans them asynchronously:
    then drafts are taken inside the worker's own model runner, which this worker is not)."""
    spec = vllm_config.speculative_config
    planned = 0 if spec is None else int(spec.num_speculative_tokens)
    if planned != k:
        raise ValueError(f"the talker decodes with speculate={k} but vLLM plans {planned} speculative tokens: pass "
                         f"speculative_config={speculative_config(k)} (TalkerLLM(..., speculate={k}) does)")
    if k and vllm_config.scheduler_config.async_scheduling:
        raise ValueError("speculative decoding through the FsmWorker needs async_scheduling=False (vLLM takes drafts "
                         "from the executor after each step only when scheduling synchronously)")


class DraftBook:
    """The drafts of the requests the last step left decoding, for `take_draft_token_ids`."""

    def __init__(self, engine: LockstepEngine) -> None:
        self.engine = engine
        self._pending: DraftTokenIds | None = None

    def after_step(self, request_ids) -> None:
        ledger = self.engine.ledger
        decoding = [rid for rid in request_ids if rid is not None and rid in ledger.records
                    and ledger.records[rid].slot is not None and ledger.records[rid].state is State.DECODING]
        if not decoding:
            self._pending = None
            return
        slots = [ledger.records[rid].slot for rid in decoding]
        drafts = self.engine.table.extra[DRAFT_TOKENS][slots].tolist()  # one device-to-host copy a step
        self._pending = DraftTokenIds(decoding, drafts)

    def take(self) -> DraftTokenIds | None:
        pending, self._pending = self._pending, None
        return pending
