"""A tiny, model-agnostic scripted talker for tests: outputs depend only on a request's own inputs."""

from __future__ import annotations

import attrs
import torch

from .. import invariant
from ..model_api import (
    FEED_COUNT, FEED_DONE, FEED_ROWS, CodebookSampler, ColumnSpec, DelayPattern, ModelSpec, MtpResult, PayloadSpec,
    PreparedPrompt, TalkerModel,
)

PROMPT_VOCAB = 97
PAYLOAD_SHAPE = (2, 3)  # variant "stop_head": the frame's continuous payload


@attrs.frozen
class ScriptInputs:
    """prompt: token ids; eos_at / nan_at: frame index at which CB0 is forced to the codec
    EOS / the logits become NaN (None = never); mtp_nan_at: same for the MTP logits."""

    prompt: tuple[int, ...]
    eos_at: int | None = None
    nan_at: int | None = None
    mtp_nan_at: int | None = None
    # A conditioned talker's feed: prompt-vocab ids of its conditioning rows, how many are
    # there at admission (None: all), and whether the feed is complete once all arrived.
    feed: tuple[int, ...] = ()
    feed_upfront: int | None = None
    feed_done: bool = True

    def whole_feed(self) -> "ScriptInputs":
        """The same request with every conditioning row there from the start."""
        return attrs.evolve(self, feed_upfront=None)


class ScriptedTalker(TalkerModel):
    """A stateful toy talker with the same contract as a real one.

    The backbone is a running mean over the slot's cached inputs (a stand-in for
    attention with a per-slot KV cache), so a frame depends on the request's whole
    history and a cache mix-up between slots changes frames. Triggers (EOS, NaN) are
    keyed by the absolute position, which is a pure function of the request's own inputs.
    Every hook is computed with mtp_fsm.invariant ops, as the TalkerModel contract asks.
    """

    def __init__(
        self,
        *,
        hidden_size: int = 16,
        num_codebooks: int = 4,
        codebook_size: int = 32,
        max_context: int = 96,
        dtype: torch.dtype = torch.float64,
        seed: int = 0,
        device: torch.device | str = "cpu",
        variant: str | None = None,
        draft_miss: int = 0,
    ) -> None:
        # Speculative decoding (engine speculate=k): the drafter spoils the drafts for every
        # position that is a multiple of draft_miss (0: none), so tests see misses at will.
        self.draft_miss = draft_miss
        # Under "mtp_stop" the MTP hook, not CB0, carries the scripted stop (eos_at).
        self.mtp_stops = variant in ("mtp_stop", "mtp_stop_deferred")
        self.conditioned = variant == "conditioned"  # the text step reads the feed columns
        # Under "delay_pattern" the two ids after the codes are BOC and EOC, legal in every
        # codebook; the scripted stop (eos_at) forces EOC on codebook 0, starting the wind-down.
        pattern = DelayPattern(boc=codebook_size, eoc=codebook_size + 1) if variant == "delay_pattern" else None
        if pattern is not None:
            codebook_size += 2
        eos = None if self.mtp_stops or pattern else codebook_size + 2 if num_codebooks > 1 else codebook_size
        self.spec = ModelSpec(
            name="scripted", hidden_size=hidden_size, num_codebooks=num_codebooks,
            backbone_vocab_size=codebook_size + (0 if pattern else 4), codebook_size=codebook_size, eos_token_id=eos,
            max_context=max_context, dtype=dtype, variant=variant, feed_capacity=max_context if self.conditioned else 0,
            forward_width=hidden_size + 2,  # the hidden row + the scripted EOS / MTP-NaN flags
            delay_pattern=pattern,
        )
        self._stop_id = eos if pattern is None else pattern.eoc
        if variant == "stop_head":  # CB0 then a continuous payload; the stop frame is published
            self.spec = attrs.evolve(self.spec, num_codebooks=1, eos_token_id=codebook_size,
                                     payload=PayloadSpec(PAYLOAD_SHAPE, dtype))
            self._stop_id = codebook_size
        g = torch.Generator().manual_seed(seed)
        h, v, q = hidden_size, codebook_size, num_codebooks

        def rand(*shape):
            # Drawn on the CPU so every device starts from the same weights.
            return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

        self.token_table = rand(PROMPT_VOCAB, h)
        self.code_tables = rand(q, v, h) * 0.5
        self.text_table = rand(8, h) * 0.1
        self.head = rand(h, self.spec.backbone_vocab_size) * 2.0
        self.mtp_heads = rand(q, h, v) * 2.0
        payload = int(torch.Size(PAYLOAD_SHAPE).numel())
        self.payload_head, self.payload_embed = rand(h, payload), rand(payload, h) * 0.5
        self.cache: torch.Tensor | None = None
        self.columns: dict[str, torch.Tensor] = {}

    def prepare(self, inputs: ScriptInputs) -> PreparedPrompt:
        ids = torch.tensor([t % PROMPT_VOCAB for t in inputs.prompt], dtype=torch.long, device=self.token_table.device)
        never = -1

        def at(x):
            return torch.tensor(never if x is None else x, dtype=torch.int64)

        feed, done = None, False
        if self.conditioned:
            rows = self.feed_rows(inputs.feed)
            upfront = len(rows) if inputs.feed_upfront is None else inputs.feed_upfront
            feed, done = rows[:upfront], inputs.feed_done and upfront >= len(rows)
        return PreparedPrompt(
            feed=feed, feed_done=done,
            prompt_embeds=self.token_table[ids],
            columns={
                "prompt_len0": torch.tensor(len(ids)), "eos_at": at(inputs.eos_at), "nan_at": at(inputs.nan_at),
                "mtp_nan_at": at(inputs.mtp_nan_at), "text_key": torch.tensor(sum(inputs.prompt) % 8),
            },
        )

    def slot_columns(self) -> dict[str, ColumnSpec]:
        cols = ("prompt_len0", "eos_at", "nan_at", "mtp_nan_at", "text_key")
        return {name: ColumnSpec((), torch.int64, -1.0 if name != "text_key" else 0.0) for name in cols}

    def bind_slots(self, max_slots, device, columns=None) -> None:
        self.cache = torch.zeros(max_slots + 1, self.spec.max_context, self.spec.hidden_size, dtype=self.spec.dtype, device=device)
        self.columns = columns or {}
        self._scratch = max_slots

    def reset_slots(self, slots: torch.Tensor) -> None:
        self.cache.index_fill_(0, slots, 0.0)  # a scalar kernel argument: no host-to-device copy

    def feed_rows(self, ids) -> torch.Tensor:
        """The conditioning rows [n, H] of feed ids (what a test hands engine.feed)."""
        index = torch.tensor([i % PROMPT_VOCAB for i in ids], dtype=torch.long, device=self.token_table.device)
        return self.token_table[index] * 0.3

    def text_step(self, columns, slots, frame_index):
        if not self.conditioned:
            return self.text_table[(columns["text_key"][slots] + frame_index) % 8]
        # Fed row, then one end-of-feed row (text_table[0]) once the feed is done, then pad (text_table[1]).
        count, done = columns[FEED_COUNT][slots], columns[FEED_DONE][slots] != 0
        rows = columns[FEED_ROWS][slots, frame_index.clamp(0, self.spec.feed_capacity - 1)]
        end = torch.where((done & (frame_index == count))[:, None], self.text_table[0], self.text_table[1])
        return torch.where((frame_index < count)[:, None], rows, end)

    def forward(self, inputs_embeds, positions, token_slots):
        slot = torch.where(token_slots >= 0, token_slots, self._scratch)
        pos = positions.clamp(max=self.spec.max_context - 1)
        self.cache[slot, pos] = inputs_embeds
        # Running mean over the slot's cache up to each token's position.
        window = torch.arange(self.spec.max_context, device=pos.device)[None, :] <= pos[:, None]
        history = torch.where(window[:, :, None], self.cache[slot], 0.0)
        hidden = invariant.tree_sum(history, 1) / (pos[:, None] + 1)
        # Frame index of the CB0 sampled at this position (for prompt rows it is 0).
        frame = (pos + 1 - self.columns["prompt_len0"][slot]).clamp(min=0)
        nan = (frame == self.columns["nan_at"][slot]) & (token_slots >= 0)
        hidden = torch.where(nan[:, None], float("nan"), hidden)
        eos = (frame == self.columns["eos_at"][slot]) & (token_slots >= 0)
        mtp_nan = (frame == self.columns["mtp_nan_at"][slot]) & (token_slots >= 0)
        flags = torch.stack([eos, mtp_nan], dim=1).to(hidden.dtype)
        return torch.cat([hidden, flags], dim=1)

    def cb0_logits(self, hidden):
        h, flags = hidden[:, : self.spec.hidden_size], hidden[:, self.spec.hidden_size:]
        logits = invariant.matmul(h, self.head)
        if self.mtp_stops:
            return logits
        forced = torch.full_like(logits, -1e4)
        forced[:, self._stop_id] = 1e4
        return torch.where(flags[:, :1] > 0, forced, logits)

    def mtp(self, hidden, cb0, sample: CodebookSampler):
        h, flags = hidden[:, : self.spec.hidden_size], hidden[:, self.spec.hidden_size:]
        if self.spec.payload is not None:  # a FrameDraws: noise, and the previous payload as state
            rows = h.shape[0]
            patch = invariant.tanh(invariant.matmul(h, self.payload_head)
                                   + self.code_tables[0][cb0][:, : self.payload_head.shape[1]])
            patch = patch.reshape(rows, *PAYLOAD_SHAPE) + 0.25 * sample.normal(PAYLOAD_SHAPE).to(h.dtype)
            patch = patch + 0.5 * sample.previous.to(h.dtype)
            return torch.where(flags[:, 1, None, None] > 0, float("nan"), patch)
        codes = [cb0]
        state = h + self.code_tables[0][cb0]
        for g in range(1, self.spec.num_codebooks):
            logits = invariant.matmul(state, self.mtp_heads[g])
            logits = torch.where(flags[:, 1:2] > 0, float("nan"), logits)
            token = sample(logits, g)
            codes.append(token)
            state = state + self.code_tables[g][token]
        codes = torch.stack(codes, dim=1)
        return MtpResult(codes, flags[:, 0] > 0) if self.mtp_stops else codes

    def draft(self, inputs, choose):
        """A drafter for speculative tests: the running mean one position ahead (what forward
        computes there, rounding aside), so a greedy target mostly accepts; the scripted EOS /
        NaN flags are invisible to it, and draft_miss spoils drafts on purpose."""
        size, scratch = self.spec.hidden_size, self._scratch
        last = inputs.last
        mean, x, position = inputs.hidden[last, :size], inputs.next_inputs[last], inputs.positions[last]
        slot = torch.where(inputs.token_slots[last] >= 0, inputs.token_slots[last], scratch)
        drafts = []
        for i in range(inputs.num_drafts):
            at = position + 1 + i  # where x sits
            mean = (mean * at[:, None] + x) / (at[:, None] + 1)
            token = choose(invariant.matmul(mean, self.head), i)
            if self.draft_miss:
                token = torch.where((at + 1) % self.draft_miss == 0, (token + 1) % self.spec.codebook_size, token)
            drafts.append(token)
            frame = (at + 1 - self.columns["prompt_len0"][slot]).clamp(min=0)
            x = self.frame_embed(token[:, None]) + self.text_step(self.columns, slot, frame)
        return torch.stack(drafts, dim=1)

    def frame_embed(self, codes):
        if self.spec.payload is not None:  # the payload [B, *PAYLOAD_SHAPE]
            return invariant.matmul(codes.reshape(codes.shape[0], -1).to(self.payload_embed.dtype), self.payload_embed)
        out = self.code_tables[0][codes[:, 0].clamp(0, self.spec.codebook_size - 1)]
        for g in range(1, self.spec.num_codebooks):
            out = out + self.code_tables[g][codes[:, g].clamp(0, self.spec.codebook_size - 1)]
        return out
