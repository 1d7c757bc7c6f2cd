"""ScriptedScheduler: vLLM MRV2-shaped SchedulerOutputs (chunked prefill, preemption, abort) from a script, recorded."""

from __future__ import annotations

import random
from typing import Iterable

import attrs

from ...engine.plan import NewRequest
from ..request_codec import EXTRA_ARGS_KEY, encode_request


@attrs.define
class _Req:
    request: NewRequest
    prompt_len: int
    outputs: list[int] = attrs.field(factory=list)
    num_computed: int = 0
    status: str = "waiting"  # waiting | running | preempted | done
    scheduled_once: bool = False


class ScriptedScheduler:
    """A small stand-in for vLLM's scheduler that emits the shapes MRV2's runner receives:

    - a new request arrives in `scheduled_new_reqs` with `prefill_token_ids` = its P
      placeholder ids; a resumed one arrives there again with prompt + outputs so far and
      `num_computed_tokens` 0 (vLLM 0.32 scheduler.py:1418-1429);
    - running requests first, then waiting ones (preempted at the front) while a slot
      (`max_num_seqs`) and the token budget last; prompts go in chunks of at most
      `chunk` tokens; a decode row is 1 token; nothing resumes in a step that preempts;
    - `preempt_at[step]` / `abort_at[step]`: ids to preempt (if running) or abort (any
      state) at that step; finished (stop id or max_tokens) and aborted ids are reported in
      the next `finished_req_ids`, preempted ones in `preempted_req_ids`;
    - `rng`: shuffles the running order each step (vLLM re-sorts rows by query length, so
      equal-length rows change places).
    Every output is kept in `recorded`, to be replayed through a fresh runner.
    """

    def __init__(self, requests: Iterable[tuple[NewRequest, int]], *, stop_token_id: int, max_num_seqs: int,
                 token_budget: int, chunk: int, preempt_at: dict[int, list[str]] | None = None,
                 abort_at: dict[int, list[str]] | None = None, rng: random.Random | None = None) -> None:
        self.reqs = {r.request_id: _Req(r, p) for r, p in requests}
        self.order = list(self.reqs)  # waiting queue (arrival order; preempted go to the front)
        self.stop_token_id, self.max_num_seqs = stop_token_id, max_num_seqs
        self.token_budget, self.chunk = token_budget, chunk
        self.preempt_at, self.abort_at = preempt_at or {}, abort_at or {}
        self.rng = rng
        self.running: list[str] = []
        self.finished_pending: set[str] = set()
        self.step_index = 0
        self.recorded: list = []
        self.aborted: set[str] = set()

    @property
    def done(self) -> bool:
        return all(r.status == "done" for r in self.reqs.values()) and not self.finished_pending

    def _params(self, req: NewRequest):
        from vllm import SamplingParams

        return SamplingParams(max_tokens=req.max_frames, stop_token_ids=[self.stop_token_id], temperature=1.0,
                              detokenize=False, extra_args={EXTRA_ARGS_KEY: encode_request(req)})

    def schedule(self):
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        step = self.step_index
        finished = set(self.finished_pending)
        self.finished_pending = set()
        for rid in self.abort_at.get(step, ()):
            r = self.reqs[rid]
            if r.status != "done":
                if r.scheduled_once:
                    finished.add(rid)
                self.running = [x for x in self.running if x != rid]
                self.order = [x for x in self.order if x != rid]
                r.status = "done"
                self.aborted.add(rid)
        preempted = {rid for rid in self.preempt_at.get(step, ()) if self.reqs[rid].status == "running"}
        for rid in preempted:
            r = self.reqs[rid]
            r.status, r.num_computed = "preempted", 0
            self.running.remove(rid)
            self.order.insert(0, rid)
        if self.rng is not None:
            self.rng.shuffle(self.running)
        budget, tokens, new, cached = self.token_budget, {}, [], []
        for rid in self.running:
            r = self.reqs[rid]
            n = min(r.prompt_len + len(r.outputs) - r.num_computed, self.chunk, budget)
            if n > 0:
                tokens[rid], budget = n, budget - n
                cached.append(rid)
        while not preempted and self.order and len(self.running) < self.max_num_seqs and budget > 0:
            rid = self.order.pop(0)
            r = self.reqs[rid]
            all_ids = [0] * r.prompt_len + r.outputs
            n = min(len(all_ids), self.chunk, budget)
            tokens[rid], budget = n, budget - n
            new.append(NewRequestData(req_id=rid, prompt_token_ids=[0] * r.prompt_len, mm_features=[],
                                      sampling_params=self._params(r.request), pooling_params=None, block_ids=([],),
                                      num_computed_tokens=0, lora_request=None, prefill_token_ids=all_ids))
            r.status, r.scheduled_once = "running", True
            self.running.append(rid)
        out = SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=cached, resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
                new_block_ids=[None] * len(cached), num_computed_tokens=[self.reqs[r].num_computed for r in cached],
                num_output_tokens=[len(self.reqs[r].outputs) for r in cached]),
            num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[],
            finished_req_ids=finished, free_encoder_mm_hashes=[], preempted_req_ids=preempted,
        )
        self.recorded.append(out)
        return out

    def update(self, out, sampled: dict[str, list[int]]) -> None:
        """The runner's tokens for `out`: advance, and finish on the stop id or max_tokens."""
        for rid, n in out.num_scheduled_tokens.items():
            r = self.reqs[rid]
            r.num_computed += n
            r.outputs += sampled.get(rid, [])
            if sampled.get(rid) and (sampled[rid][-1] == self.stop_token_id or len(r.outputs) >= r.request.max_frames):
                r.status = "done"
                self.running.remove(rid)
                self.finished_pending.add(rid)
        self.step_index += 1
