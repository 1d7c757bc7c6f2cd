"""A speculative step on the device: one forward over each decode row's last token and its drafts, the verify positions as rows, then the drafter from the last accepted token."""

from __future__ import annotations

import attrs
import torch

from ..errors import ModelBindingError
from ..kernels.contract import OUT_ERROR, OUT_REASON, OUT_STATE, StepBatch
from ..kernels.reference import in_class, owned_rows
from ..lifecycle import CLASS_LIVE
from ..model_api import ColumnSpec, DraftInputs
from ..sampling import row_faults, sample_tokens
from ..sampling.params import NO_SAMPLED_ROWS
from ..sampling.faults import FAULT_DRAFT, fault_word

# Engine-owned slot column: the k tokens the drafter proposed for the row's next step (reset
# with the row at admission; a resumed request re-drafts from its replayed prompt).
DRAFT_TOKENS = "draft_tokens"


MAX_DRAFTS = 16


@attrs.define
class SpeculationStats:
    """Counters of an engine's verify rows (host side, from each step's output copy).

    accepted counts drafts that were accepted and published (a draft accepted at the
    position where the target then sampled EOS ends the request unpublished: not counted)."""

    num_drafts: int  # k: the most drafts a step verifies (DraftPolicy chooses how many)
    verify_rows: int = 0  # decode rows verified (one per request per step, with 0..k drafts)
    proposed: int = 0  # drafts verified: the step's draft count per verify row
    accepted: int = 0
    frames: int = 0  # frames the verify rows published (accepted drafts + one bonus each)

    def record(self, verify, published):
        """verify: bool [B] rows that verified drafts; published: bool [B, d + 1] per position
        (d: the step's draft count). Returns drafts accepted per verify row."""
        rows = published[verify]
        accepted = rows[:, 1:].sum(axis=1)
        self.verify_rows += len(rows)
        self.proposed += (rows.shape[1] - 1) * len(rows)
        self.accepted += int(accepted.sum())
        self.frames += int(rows.sum())
        return accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def drafts_per_row(self) -> float:
        """Drafts a verify row carried on average (k under the fixed policy, less where the
        adaptive one backed off)."""
        return self.proposed / self.verify_rows if self.verify_rows else 0.0

    @property
    def frames_per_row(self) -> float:
        """Frames a request gets per verify step (1.0 without speculation)."""
        return self.frames / self.verify_rows if self.verify_rows else 0.0


def check_speculation(model, speculate: int, lifecycle, policy) -> None:
    """Refuse (ModelBindingError) an engine that cannot run `speculate` drafts per step."""
    if type(speculate) is not int or not 0 <= speculate <= MAX_DRAFTS:
        raise ModelBindingError(f"speculate must be an int in [0, {MAX_DRAFTS}], got {speculate!r}")
    if lifecycle is not None and speculate and not lifecycle.verify_loop:
        raise ModelBindingError(f"speculate={speculate} needs a lifecycle with a verify loop ('speculative'), "
                                f"got {lifecycle.name!r}")
    if not speculate and (lifecycle is None or not lifecycle.verify_loop):
        return
    spec, problems = model.spec, []
    if speculate and not model.can_draft:
        problems.append("it has no drafter (TalkerModel.draft)")
    if spec.has_mtp or spec.num_codebooks != 1 or spec.delay_pattern is not None:
        problems.append("a verified frame must be one token (single codebook, no MTP stage, payload or delay pattern)")
    if spec.has_feed:
        problems.append("drafts cannot read conditioning rows that have not arrived (a model with a feed)")
    if policy.token_budget < 1 + speculate:
        problems.append(f"the token budget {policy.token_budget} cannot hold one verify row of {1 + speculate} tokens")
    if problems:
        raise ModelBindingError(f"model {spec.name!r} cannot decode speculatively (speculate={speculate}): "
                                + "; ".join(problems))


def draft_columns(lifecycle, num_drafts: int) -> dict[str, ColumnSpec]:
    if not lifecycle.verify_loop or num_drafts == 0:
        return {}
    return {DRAFT_TOKENS: ColumnSpec((num_drafts,), torch.int64)}


class SpeculativeStep:
    """The device pipeline of the `speculative` lifecycle (see its docstring) with up to k
    drafts: each step verifies `verify` drafts per decode row (what the previous step
    proposed) and proposes `propose` for the next (engine-set from its DraftPolicy; both k
    under the fixed one). The draft column holds k; a step uses its first `verify`.

    Holds the engine's parts, never the engine (DevicePipeline's reason)."""

    def __init__(self, spec, kernels, table, device_lifecycle, calls, allowed, num_drafts: int) -> None:
        self.spec, self.kernels, self.table, self._lc = spec, kernels, table, device_lifecycle
        self._forward, self._cb0_logits, self._draft, self._frame_embed, self._text_step = calls
        self._allowed, self.num_drafts = allowed, num_drafts
        self.verify, self.propose = num_drafts, num_drafts

    @property
    def positions(self) -> int:
        """Verify positions per row this step: packed output rows per step row."""
        return self.verify + 1

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Returns the packed output [B * (k + 1), C], row-major: row b's verify positions in
        order, each holding the frame published there (if any); every position carries the
        row's state, reason, error and frame count after the whole step.

        The positions are rows: one head call and one draw over all B x (k + 1) of them, the
        verify loop's stages over all positions at once (kernels' `verify_frames`), then the
        drafter from each row's last accepted token."""
        k, kern, table, lc = self.verify, self.kernels, self.table, self._lc
        slot, positions = batch.idx_mapping, k + 1
        owned = start = None
        if k or self.propose:
            owned = owned_rows(table, batch)
            start = table.num_computed[slot].clone()
        inputs, token_positions, token_slots = kern.compose_inputs(table, lc, batch, self._text_step)
        if k:
            live = in_class(lc, table.state[slot], CLASS_LIVE)
            verify = owned & live & (start >= table.prompt_len[slot]) & (batch.num_scheduled == positions)
            # Only a verify row has drafts (a prefill row's column holds no draft for it).
            drafts = table.extra[DRAFT_TOKENS][slot, :k]
            inputs = self._with_drafts(batch, verify, drafts, inputs)
        hidden = self._forward(inputs, token_positions, token_slots)
        packed = self.verify_positions(batch, verify, drafts, hidden) if k else self.one_position(batch, hidden)
        self._propose(batch, owned, start, inputs, hidden, token_positions, token_slots)
        out = packed.view(slot.shape[0], positions, -1)
        # The drafter's stage may end a row: its columns after the whole step.
        for column, values in ((OUT_STATE, table.state), (OUT_REASON, table.finish_reason), (OUT_ERROR, table.error)):
            out[:, :, column] = values[slot].to(out.dtype)[:, None]
        return packed

    def verify_positions(self, batch: StepBatch, verify: torch.Tensor, drafts: torch.Tensor,
                         hidden: torch.Tensor) -> torch.Tensor:
        """The verify loop over the forward's hidden states: position j of a verify row samples
        at its j-th token, any other row once, at its last. -> packed [B * (k + 1), C]."""
        kern, positions = self.kernels, drafts.shape[1] + 1
        offsets = torch.arange(positions, device=hidden.device)
        rows_at = torch.where(verify[:, None], batch.query_start_loc[:-1, None] + offsets, batch.last_token[:, None])
        logits = self._cb0_logits(hidden[rows_at.reshape(-1)])
        eos = self.spec.eos_token_id
        tokens, faults = kern.sample_positions(self.table, batch, verify, logits, drafts, eos_token_id=eos,
                                               allowed=self._allowed)
        embeds = self._frame_embed(tokens.reshape(-1, 1))
        return kern.verify_frames(self.table, self._lc, batch, verify, tokens, faults, drafts, embeds, eos_token_id=eos)

    def one_position(self, batch: StepBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The verify loop when no row has drafts (the adaptive policy drafted none): its one
        position is the plain sample and publish stages at each row's last token, with
        DRAFT_ACCEPTED false (verify_loop.py's position 0), without the all-positions
        machinery. -> packed [B, C]."""
        kern, eos = self.kernels, self.spec.eos_token_id
        logits = self._cb0_logits(hidden[batch.last_token])
        codes = kern.sample_cb0(self.table, self._lc, batch, logits, eos_token_id=eos, allowed=self._allowed)[:, None]
        return kern.publish_frames(self.table, self._lc, batch, codes, self._frame_embed(codes), last=False)

    def _with_drafts(self, batch: StepBatch, verify: torch.Tensor, drafts: torch.Tensor,
                     inputs: torch.Tensor) -> torch.Tensor:
        """A verify row's token j >= 1 carries draft j - 1, embedded as the frame it would be
        (frame index num_frames - 1 + j, with its text step)."""
        table, rows, offsets = self.table, batch.token_rows, batch.token_offsets
        token_slot = batch.idx_mapping[rows]
        drafted = verify[rows] & (offsets >= 1)
        ids = drafts[rows, (offsets - 1).clamp(0, drafts.shape[1] - 1)]
        frame_index = (table.num_frames[token_slot] - 1 + offsets).clamp(min=0)
        embeds = self._frame_embed(ids[:, None]) + self._text_step(table.extra, token_slot, frame_index).to(inputs.dtype)
        return torch.where(drafted[:, None], embeds.to(inputs.dtype), inputs)

    def _propose(self, batch: StepBatch, owned: torch.Tensor, start: torch.Tensor, inputs: torch.Tensor,
                 hidden: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor) -> None:
        """The drafter from each row's last accepted token (`DraftInputs`); then the draft
        stage (the step's last: rows left in-step are flagged)."""
        k, table, slot = self.propose, self.table, batch.idx_mapping
        faults = torch.zeros(slot.shape, dtype=torch.int32, device=slot.device)
        if k:
            end = table.num_computed[slot]
            advanced = end - start  # verify rows: 1 + accepted drafts; prefill rows: the chunk
            has = owned & (advanced > 0)
            last = (batch.query_start_loc[:-1] + advanced - 1).clamp(min=0)
            # The input after each row's newest computed token: the newest published frame
            # (frame_embed + its text step, as the next step composes it) or the next prompt row.
            frame_index = (table.num_frames[slot] - 1).clamp(min=0)
            follow = (table.frame_embed[slot] + self._text_step(table.extra, slot, frame_index)).to(inputs.dtype)
            # Where the drafter's later steps sit: the positions after the newest token.
            chain = end[:, None] + torch.arange(k - 1, device=end.device)[None, :]
            chain = (chain.clamp(max=table.max_context - 1),
                     torch.where(has[:, None] & (chain < table.max_context), slot[:, None], -1))
            if batch.has_prefill:
                prompt = table.prompt_embeds[slot, end.clamp(max=table.max_context - 1)]
                follow = torch.where((end < table.prompt_len[slot])[:, None], prompt.to(inputs.dtype), follow)
                draft_inputs = self._over_the_step(has, last, follow, chain, inputs, hidden, positions, token_slots, k)
            else:
                draft_inputs = self._from_last_accepted(has, advanced, last, follow, chain, inputs, hidden, positions,
                                                        token_slots, k)
            proposed = self._draft(draft_inputs, self._chooser(batch, faults)).to(torch.int64)
            column = table.extra[DRAFT_TOKENS]
            column[slot, :k] = torch.where(has[:, None], proposed, column[slot, :k])
            faults = torch.where(has, faults, 0)
        self.kernels.mtp_scatter(table, self._lc, batch, faults, None, last=True)

    def _from_last_accepted(self, has, advanced, last, follow, chain, inputs, hidden, positions,
                            token_slots, k: int) -> DraftInputs:
        """An all-decode step: two tokens per row, its last accepted one and the one before it
        (inert unless this step computed it). The one before writes the drafter's KV at the
        position the previous step's draft chain stopped short of when every draft was
        accepted, so the drafter never attends over a position it did not write."""
        rows = last.shape[0]
        pair = torch.stack([last - 1, last], dim=1).clamp(min=0).reshape(-1)
        keep = torch.stack([has & (advanced >= 2), has], dim=1).reshape(-1)
        next_inputs = torch.stack([inputs[last], follow], dim=1).reshape(2 * rows, -1)
        slots = torch.where(keep, token_slots[pair], -1)
        newest = torch.arange(rows, device=last.device) * 2 + 1
        return DraftInputs(hidden[pair], next_inputs, positions[pair], slots, newest, *chain, k)

    def _over_the_step(self, has, last, follow, chain, inputs, hidden, positions, token_slots, k: int) -> DraftInputs:
        """A step with prefill rows: every token of the step (a prompt chunk's drafter KV is
        read by every later draft), each followed by the next token's input."""
        tokens = inputs.shape[0]
        shifted = torch.cat([inputs[1:], inputs.new_zeros(2, inputs.shape[1])])  # row `tokens` is a sink
        shifted[torch.where(has, last, tokens)] = follow
        return DraftInputs(hidden, shifted[:tokens], positions, token_slots, last.clamp(max=max(tokens - 1, 0)), *chain,
                           k)

    def _chooser(self, batch: StepBatch, faults: torch.Tensor):
        """Draft i of a row is drawn as the target will sample that frame (num_frames + i):
        the row's CB0 temperature / top-k / top-p and the same counter-based noise. Where the
        drafter's distribution matches the target's, the two Gumbel-max draws then pick the
        same id (a coupling: greedy rows draft the argmax, sampled rows are accepted at about
        the rate greedy ones are). The frames never depend on it: a draft only decides which
        positions are verified."""
        allowed, table, slot = self._allowed, self.table, batch.idx_mapping
        params = (table.cb0_temperature[slot], table.cb0_top_k[slot], table.cb0_top_p[slot], table.seed[slot])
        first = table.num_frames[slot]

        k_min = batch.cb0_top_k_min
        if k_min is not None and (k_min >= NO_SAMPLED_ROWS or k_min == batch.cb0_top_k_max == 1):
            # Every row is greedy or keeps one id: its draw is the argmax, no noise to draw.
            def choose(logits: torch.Tensor, index: int) -> torch.Tensor:
                clean, kind = row_faults(logits, allowed)
                new = (kind != 0) & (faults == 0)
                faults.copy_(torch.where(new, fault_word(FAULT_DRAFT, index), faults))
                return clean.argmax(dim=-1)

            return choose

        def choose(logits: torch.Tensor, index: int) -> torch.Tensor:
            tokens, kind = sample_tokens(logits, *params, first + index, 0, allowed=allowed,
                                         apply_filters=batch.cb0_filters, top_k_max=batch.cb0_top_k_max,
                                         any_top_p=batch.cb0_any_top_p, top_k_min=batch.cb0_top_k_min)
            new = (kind != 0) & (faults == 0)
            faults.copy_(torch.where(new, fault_word(FAULT_DRAFT, index), faults))
            return tokens

        return choose
