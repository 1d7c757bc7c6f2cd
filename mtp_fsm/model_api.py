"""The contract between the engine and a talker model adapter (models depend on this only)."""

from __future__ import annotations

import abc
from typing import Any, Callable

import attrs
import torch

from .sampling.params import SamplingParams
from .sampling.penalties import PENALTY_BEFORE_TEMPERATURE, PENALTY_ORDERS

# A sampler the engine hands to the MTP hook: (logits [B, V], codebook index[, params]) ->
# tokens [B]. It applies each row's own MTP sampling parameters (or `params`, a draw whose
# parameters the model owns, e.g. MOSS's stop head, sampled as codebook index Q) and
# counter-based noise keyed by (seed, frame, codebook), so the model never sees seeds,
# generators or request ids.
CodebookSampler = Callable[..., torch.Tensor]


class FrameDraws:
    """What the MTP hook of a model with a payload gets as its `sample` argument: the
    CodebookSampler (callable as one), plus per-row draws keyed like the engine's noise, so
    a payload never depends on the batch, the slot or a resume.

    normal(shape) -> float32 [B, *shape]: standard Gaussian noise, a pure function of (the
      request's seed, the frame index, the element index).
    previous: [B, *payload shape] the row's last published payload (zeros before the first).
    """

    def __init__(self, sample: CodebookSampler, normal: Callable[[tuple[int, ...]], torch.Tensor],
                 previous: torch.Tensor) -> None:
        self._sample, self._normal, self.previous = sample, normal, previous

    def __call__(self, logits: torch.Tensor, codebook: int, params=None) -> torch.Tensor:
        return self._sample(logits, codebook) if params is None else self._sample(logits, codebook, params)

    def normal(self, shape: tuple[int, ...]) -> torch.Tensor:
        return self._normal(tuple(shape))


# What the engine hands a drafter to pick each draft token with: (logits [B, V], draft
# index i in 0..k-1) -> tokens [B]. Greedy over the ids a frame may hold; a row whose logits
# are not finite is recorded as a drafter fault (its request ends with reason error).
DraftChooser = Callable[[torch.Tensor, int], torch.Tensor]


@attrs.frozen
class DraftInputs:
    """What a drafter (`TalkerModel.draft`, speculative decoding) gets from one step.

    The drafter runs from each row's last accepted token, batched across rows. Flat over N
    tokens whose drafter state (e.g. an MTP layer's KV) the engine asks it to write:
      - a step where every row decodes: N = 2B, two per row in order: the one before the
        row's last accepted token (inert, slot -1, unless this step computed it), then the
        last accepted token. The earlier one rewrites the position the previous step's
        draft chain stops short of when every draft was accepted, so a drafter never
        attends over a position it has not written;
      - a step with prefill rows: N = T, every token of the step as forward() got it (a
        prompt chunk's drafter state is read by every later draft).
      hidden [N, *]: forward()'s output at each token;
      next_inputs [N, H]: the backbone input of the position after each token (the next
        prompt row, or the embedding of the token published there); meaningful up to each
        row's last accepted token;
      positions [N], token_slots [N]: as forward() got them (-1: inert, write nothing).
    Per row (B):
      last [B]: index into the N tokens of the row's last accepted token (its hidden state
        predicted the newest published token, whose input is next_inputs[last]): draft 0
        comes from there;
      chain_positions, chain_slots [B, k - 1]: where the drafter's own later draft steps sit
        (position of the newest token + i, i = 0..k-2; slot -1 where that is past the context).
    A row with nothing new this step (ended, not owned) has inert tokens; its drafts are ignored.
    num_drafts: the drafts this step proposes per row, 1..k (the engine's DraftPolicy); a step
    that proposes none does not call the drafter, so the positions it computed are never
    written to the drafter's state (its drafts there may be worse, never the frames).
    """

    hidden: torch.Tensor
    next_inputs: torch.Tensor
    positions: torch.Tensor
    token_slots: torch.Tensor
    last: torch.Tensor
    chain_positions: torch.Tensor
    chain_slots: torch.Tensor
    num_drafts: int


@attrs.frozen
class ColumnSpec:
    """An extra per-slot column a model registers in the slot table: shape is per row."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float = 0.0


# Integer views that carry a float payload's bits, by element size: every bit survives the
# int64 frame row (sign-extended), so a payload round-trips exactly.
_BITS_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16}


@attrs.frozen
class PayloadSpec:
    """A frame's continuous payload (VoxCPM2's latent patch [patch_size, feat_dim]).

    The frame of such a model is its CB0 (the sampled token, e.g. a stop class) followed by
    the payload, which the MTP hook returns [B, *shape] in `dtype`. The engine carries the
    payload's elements bit-exactly as int64 words of the frame row (slot frame log, packed
    output, resume replay), so one copy per step and exact resumes hold for any payload."""

    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: torch.dtype = torch.float32

    def __attrs_post_init__(self) -> None:
        if not self.shape or any(type(n) is not int or n < 1 for n in self.shape):
            raise ValueError(f"payload shape must be positive ints, got {self.shape!r}")
        if not self.dtype.is_floating_point or self.dtype.itemsize not in _BITS_VIEW:
            raise ValueError(f"payload dtype must be a 16-, 32- or 64-bit float, got {self.dtype}")

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    def encode(self, payload: torch.Tensor) -> torch.Tensor:
        """[B, *shape] -> int64 words [B, numel] holding each element's bits."""
        rows = payload.to(self.dtype).reshape(payload.shape[0], self.numel).contiguous()
        return rows.view(_BITS_VIEW[self.dtype.itemsize]).to(torch.int64)

    def decode(self, words: torch.Tensor) -> torch.Tensor:
        """int64 words [B, numel] -> the payload [B, *shape] (a new tensor: never a view of `words`)."""
        bits = words.to(_BITS_VIEW[self.dtype.itemsize])
        return bits.view(self.dtype).reshape(words.shape[0], *self.shape)


@attrs.frozen
class DelayPattern:
    """A MusicGen-style delay pattern over the frame's Q codebooks (Higgs Audio v3), which the
    engine enforces on every sampled codebook and the `delay_pattern` lifecycle follows.

    Frame f: codebook q > f is forced to `boc` (ramp-up: codebook q starts q frames late).
    Otherwise `boc` may not be sampled, and `eoc` only on codebook 0. A frame whose codebook 0
    is `eoc` starts the wind-down: the frame after a frame holding m `eoc` codes has
    codebooks q <= m forced to `eoc`, so the Q-1'th frame after it is all `eoc` and ends the
    request (reason eos)."""

    boc: int
    eoc: int


@attrs.frozen
class ModelSpec:
    """Static facts about a talker that the engine sizes its tables and kernels from."""

    name: str
    hidden_size: int
    num_codebooks: int  # Q; 1 means a single-codebook model with no MTP stage
    backbone_vocab_size: int  # size of the CB0 head (codec ids + specials)
    codebook_size: int  # valid code ids are [0, codebook_size) in every codebook
    eos_token_id: int | None  # codec EOS sampled as CB0 ends the request without a frame
    max_context: int  # positions per slot in the KV cache (prompt + frames)
    dtype: torch.dtype = torch.float32
    # The lifecycle variant (mtp_fsm.lifecycle.VARIANTS); None: "mtp" or "single_codebook"
    # from num_codebooks. "mtp_stop": the MTP hook returns MtpResult and its stop ends the
    # request; "conditioned": the text step reads an external feed (feed_capacity > 0).
    variant: str | None = None
    # Sampling owned by the model, not the request (MOSS: fixed audio sampling): when set,
    # it replaces every request's CB0 / MTP sampling parameters at admission (seeds stay).
    cb0_sampling: SamplingParams | None = None
    mtp_sampling: SamplingParams | None = None
    # Conditioning feed (Qwen3-Omni thinker rows): rows [feed_capacity, hidden_size] per
    # slot, appended over time with engine.feed(); see FEED_* columns below.
    feed_capacity: int = 0
    feed_width: int = 0  # width of one fed row (0: hidden_size); the model's text_step projects it
    # Width of forward()'s output rows when it is not hidden_size (a model carrying side
    # channels to its heads): what the deferred schedule caches per slot between steps.
    forward_width: int = 0
    # Defaults for requests that leave them unset (None): the CB0 repetition penalty
    # (SamplingParams.repetition_penalty; 1.0 = none) and the frames before EOS may be
    # sampled (NewRequest.min_frames).
    repetition_penalty: float = 1.0
    min_frames: int = 0
    # Where the CB0 repetition penalty acts, as the model's upstream sampler does it
    # (sampling.penalties): "before_temperature" on the logits (HF generate: Qwen3-TTS), or
    # "after_filters" on the temperature-scaled scores top-k / top-p kept (Chatterbox Turbo's
    # inference_turbo). The orders sample different tokens, so it is the model's, not the request's.
    repetition_penalty_order: str = attrs.field(default=PENALTY_BEFORE_TEMPERATURE)
    # Variant "delay_pattern": the codebook delay pattern the engine enforces (None: none).
    # Such a model refuses CB0 repetition penalties and min_frames at admission (the
    # pattern's fillers would count as repeats, and the stop is the pattern's own).
    delay_pattern: DelayPattern | None = None
    # A continuous frame payload (variant "stop_head", VoxCPM2): num_codebooks is 1 (CB0),
    # the MTP hook returns the payload, frame_embed receives it (not codes).
    payload: PayloadSpec | None = None

    @repetition_penalty_order.validator
    def _check_penalty_order(self, attribute, value) -> None:
        if value not in PENALTY_ORDERS:
            raise ValueError(f"{self.name}: repetition_penalty_order must be one of {PENALTY_ORDERS} (where the "
                             f"CB0 repetition penalty acts: on the logits, or on the scores after temperature, "
                             f"top-k and top-p), got {value!r}")

    @property
    def has_mtp(self) -> bool:
        return self.num_codebooks > 1 or self.payload is not None

    @property
    def frame_width(self) -> int:
        """int64 words per frame row: the Q codes, then the payload's elements (if any)."""
        return self.num_codebooks + (0 if self.payload is None else self.payload.numel)

    @property
    def has_feed(self) -> bool:
        return self.feed_capacity > 0

    @property
    def lifecycle(self) -> str:
        """Name of the lifecycle variant this model runs under (see mtp_fsm.lifecycle)."""
        if self.variant is not None:
            return self.variant
        return "mtp" if self.has_mtp else "single_codebook"


# The engine-owned slot columns of a model with a conditioning feed (spec.feed_capacity > 0),
# handed to text_step / forward with the model's own columns:
FEED_ROWS = "feed_rows"  # [feed_capacity, feed_width] spec.dtype: the rows fed so far
FEED_COUNT = "feed_count"  # int64 []: how many rows were fed
FEED_DONE = "feed_done"  # int64 []: 1 once the feed is finished (no more rows will come)
# The engine computes a decode row only when the conditioning row its text step reads
# (index = the frame_index argument of text_step) exists: frame_index < feed_count, or the
# feed is done (then the model supplies its own end-of-feed rows, e.g. tts_eos then tts_pad).
# Otherwise the request waits in state `starved` until engine.feed() brings the row.


@attrs.frozen
class MtpResult:
    """What an MTP hook returns when the MTP stage also decides the stop (variant
    "mtp_stop", e.g. MOSS-TTS Local's local transformer: (continue, codes)).

    codes: [B, Q] with codes[:, 0] == cb0; stop: bool [B], True where the request stops
    here (that frame is not published; the request finishes with reason eos)."""

    codes: torch.Tensor
    stop: torch.Tensor


@attrs.frozen
class PreparedPrompt:
    """What a model derives from a request's inputs at admission (host side, once).

    prompt_embeds: [P, H] backbone input embeddings of the prompt.
    columns: values for the model's registered slot columns (leading dims may be shorter
      than the column's shape; the rest is filled with the column's fill value).
    """

    prompt_embeds: torch.Tensor
    columns: dict[str, torch.Tensor] = attrs.field(factory=dict)
    # A model with a conditioning feed: the rows already there at admission [n, feed_width]
    # (more arrive through engine.feed), and whether the feed is already complete.
    feed: torch.Tensor | None = None
    feed_done: bool = False


def feed_columns(spec: "ModelSpec") -> dict[str, "ColumnSpec"]:
    """The engine-owned slot columns of a model with a conditioning feed (none without)."""
    if not spec.has_feed:
        return {}
    width = spec.feed_width or spec.hidden_size
    return {
        FEED_ROWS: ColumnSpec((spec.feed_capacity, width), spec.dtype),
        FEED_COUNT: ColumnSpec((), torch.int64),
        FEED_DONE: ColumnSpec((), torch.int64),
    }


@attrs.frozen
class KVCacheLayout:
    """The backbone's per-position KV memory, for a host that accounts for it in blocks
    (vLLM's KV-cache manager): `num_layers` (K, V) pairs of [kv_heads, head_dim] each."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_position(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.itemsize


class TalkerModel(abc.ABC):
    """A talker backbone plus (optionally) its MTP hook, driven by the lockstep engine.

    Every method is batched over rows and must be free of host synchronisation so a
    step can be captured whole; rows the engine does not keep are computed and ignored.
    Results for one row must depend only on that row's inputs (request isolation).

    Batch invariance (DESIGN 2.5.1): for frames that do not depend on the batch, row order,
    slot or padding, the bits of each row of these outputs must depend on that row's inputs
    alone, never on how many rows (tokens) the call has or where the row sits:
      forward (per token), cb0_logits, text_step, frame_embed, mtp (its codes or payload and
      every logits tensor it hands the sampler), draft (the logits it hands the chooser).
    BLAS matmuls, ATen reductions and ATen's elementwise transcendentals do not guarantee
    this on every CPU (measured: MKL's AVX2 gemm path, AMD EPYC); `mtp_fsm.invariant` has
    ops that do, also across CPU kernel sets. `mtp_fsm.testing.row_invariance` checks a
    model's hooks at the shapes it really uses. The shipped tiny talkers set it
    (`batch_invariant=True`); a real-size config trades it for BLAS speed unless asked.
    """

    spec: ModelSpec

    @abc.abstractmethod
    def prepare(self, inputs: Any) -> PreparedPrompt:
        """Turn a request's model-specific inputs into prompt embeddings and column values."""

    def slot_columns(self) -> dict[str, ColumnSpec]:
        """Extra per-slot columns (text-conditioning, delay buffers, ...). Default: none."""
        return {}

    @abc.abstractmethod
    def bind_slots(self, max_slots: int, device: torch.device, columns: dict[str, torch.Tensor] | None = None) -> None:
        """Allocate per-slot model state (KV cache) for max_slots rows.

        columns: the slot table's tensors for this model's registered columns (rows
        max_slots + 1, the last is scratch), for models whose forward reads them.
        """

    def kv_cache_layout(self) -> KVCacheLayout | None:
        """The per-position KV memory of one slot (None: the model keeps no KV cache)."""
        return None

    @abc.abstractmethod
    def reset_slots(self, slots: torch.Tensor) -> None:
        """Clear per-slot model state of these slots (called on admit: no stale KV)."""

    @abc.abstractmethod
    def text_step(
        self, columns: dict[str, torch.Tensor], slots: torch.Tensor, frame_index: torch.Tensor
    ) -> torch.Tensor:
        """Text conditioning added to the input that carries frame `frame_index`: [B, H].

        columns are the model's registered slot columns; slots index their rows (padding
        rows point at the scratch row max_slots); return anything finite for those.
        """

    @abc.abstractmethod
    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor
    ) -> torch.Tensor:
        """Backbone over a flat token batch [T, H] writing KV at (slot, position); -> [T, H].

        token_slots is -1 for padding tokens, which must not touch any slot's state.
        """

    @abc.abstractmethod
    def cb0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Backbone head over the hidden state at each row's last token: [B, V0]."""

    def mtp(
        self, hidden: torch.Tensor, cb0: torch.Tensor, sample: CodebookSampler
    ) -> torch.Tensor:
        """Predict the frame's codebooks 1..Q-1 from the sampling hidden state and CB0.

        Returns codes [B, Q] with codes[:, 0] == cb0 (or an MtpResult under the "mtp_stop"
        variant). Only called when spec.has_mtp. A model with a payload returns the payload
        [B, *spec.payload.shape]; its `sample` is then a FrameDraws (counter-based Gaussian
        noise and the row's previous payload).
        """
        raise NotImplementedError(f"{self.spec.name} has no MTP stage")

    def draft(self, inputs: DraftInputs, choose: DraftChooser) -> torch.Tensor:
        """Speculative decoding (a single-codebook model with a drafter, e.g. an MTP module):
        propose the next `inputs.num_drafts` tokens of each row, [B, k] int64, picking draft i
        with `choose(logits [B, V], i)` (the engine draws it as the target will sample that
        frame: same parameters, same counter noise). Writes its own state (DeepSeek-V3's MTP
        KV) at the tokens `inputs` lists (see DraftInputs) and along its draft chain; entries
        written for rejected positions are rewritten before they are read (each step starts
        at the first unverified position). Draft quality changes speed, never the frames."""
        raise NotImplementedError(f"{self.spec.name} has no drafter")

    @property
    def can_draft(self) -> bool:
        """Whether this model implements `draft` (the engine's `speculate` needs one)."""
        return type(self).draft is not TalkerModel.draft

    @abc.abstractmethod
    def frame_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """Backbone input contribution of a complete frame [B, Q] -> [B, H] (no text step);
        a model with a payload gets the payload [B, *shape] instead of codes.

        Must be computed in a fixed order per row so the same codes give the same bits
        whatever the batch (resume recomputes published frames with it).
        """
