"""SlotTable: the struct-of-arrays device tensors [max_slots, ...] that hold the truth."""

from __future__ import annotations

import attrs
import torch

from ..lifecycle import FinishReason
from ..lifecycle.device_tables import ERR_ILLEGAL  # noqa: F401 (one of the sticky bits below)
from ..model_api import ColumnSpec, ModelSpec
from ..sampling.penalties import PENALTY_BEFORE_TEMPERATURE

# Sticky error bits (the `error` column); any set bit is an engine bug, reported loudly.
ERR_IDENTITY = 1  # a row's expected request serial does not match the slot's owner
# ERR_ILLEGAL = 2: a host trigger the table does not declare, or a row no stage could move
# (defined by the lifecycle, whose phase tables carry it).
ERR_SPAN = 4  # a prefill span runs past the prompt, or a decode row has no frame

# Rows of `SlotTable.lifecycle_words`: the int32 columns every lifecycle phase reads and writes.
WORD_STATE, WORD_REASON, WORD_ERROR, WORD_FAULT = range(4)
# Rows of `SlotTable.progress`: the int64 columns saying who owns a slot and how far its request got.
PROGRESS_SERIAL, PROGRESS_PROMPT_LEN, PROGRESS_COMPUTED, PROGRESS_FRAMES, PROGRESS_MAX_FRAMES = range(5)
# Each block's columns in row order: the block is the storage, the columns views of its rows.
BLOCKS = {
    "lifecycle_words": ("state", "finish_reason", "error", "fault"),
    "progress": ("serial", "prompt_len", "num_computed", "num_frames", "max_frames"),
}


@attrs.define(eq=False)
class SlotTable:
    """Every per-request fact the step kernels read or write, indexed by slot.

    Core columns are attrs fields; a model's own columns live in `extra`. Every column has
    max_slots + 1 rows: row max_slots is scratch, so padding rows need no branch. Admission
    re-initialises every column of the row (see `column_defaults`), so a recycled slot
    carries nothing of its previous owner.
    """

    max_slots: int
    max_context: int
    num_codebooks: int  # words per frame row: Q codes, then a payload's elements (ModelSpec.frame_width)
    hidden_size: int
    device: torch.device
    state: torch.Tensor = attrs.field(init=False)  # int32 [R], State codes
    serial: torch.Tensor = attrs.field(init=False)  # int64 [R], owner's admission serial (0 = none): identity guard
    prompt_len: torch.Tensor = attrs.field(init=False)  # int64 [R], prompt positions (incl. replayed frames on resume)
    num_computed: torch.Tensor = attrs.field(init=False)  # int64 [R], positions computed (KV written)
    num_frames: torch.Tensor = attrs.field(init=False)  # int64 [R], frames published (= next frame index)
    max_frames: torch.Tensor = attrs.field(init=False)  # int64 [R], frame budget
    finish_reason: torch.Tensor = attrs.field(init=False)  # int32 [R], FinishReason codes
    frame_embed: torch.Tensor  # [R, H] embedding sum of the last published frame
    frame_codes: torch.Tensor  # int64 [R, Q] codes of the last published frame
    frame_log: torch.Tensor  # int64 [R, C, Q] codes of every published frame (resume replays them)
    seed: torch.Tensor  # int64 [R]
    cb0_temperature: torch.Tensor
    cb0_top_k: torch.Tensor
    cb0_top_p: torch.Tensor
    mtp_temperature: torch.Tensor
    mtp_top_k: torch.Tensor
    mtp_top_p: torch.Tensor
    cb0_penalty: torch.Tensor  # float32 [R], CB0 repetition penalty (1.0 = none)
    min_frames: torch.Tensor  # int64 [R], CB0 EOS is masked while num_frames < min_frames
    # int32 [R, V0]: how often each CB0 id was published (the repetition penalty's memory;
    # a resumed row gets it rebuilt from its replayed frames at admission).
    cb0_counts: torch.Tensor
    error: torch.Tensor = attrs.field(init=False)  # int32 [R], sticky ERR_* bits
    # int32 [R], the sampling fault that ended the request (0 = none): kind | codebook << 4
    # (sampling.faults; codebook 0 = CB0), written once, by the stage whose phase ended it.
    fault: torch.Tensor = attrs.field(init=False)
    prompt_embeds: torch.Tensor  # [R, C, H] prompt (and replayed frame) input embeddings
    # int32 [4, R]: state, finish_reason, error and fault are views of its rows (WORD_*), so a
    # phase reads and writes all four with one gather and one scatter. Not a column of its own.
    lifecycle_words: torch.Tensor
    # int64 [5, R]: serial, prompt_len, num_computed, num_frames and max_frames are views of its
    # rows (PROGRESS_*), so a stage reads the ones it tests with one gather. Not a column either.
    progress: torch.Tensor
    extra: dict[str, torch.Tensor] = attrs.field(factory=dict)
    extra_fill: dict[str, float] = attrs.field(factory=dict)  # a fresh row's value per model column
    # Where the CB0 repetition penalty acts (ModelSpec.repetition_penalty_order): the model's,
    # so one value for the table, read on the host by the sampling kernels (no device value).
    cb0_penalty_order: str = PENALTY_BEFORE_TEMPERATURE

    def __attrs_post_init__(self) -> None:
        for block, names in BLOCKS.items():
            for row, name in enumerate(names):
                object.__setattr__(self, name, getattr(self, block)[row])

    @classmethod
    def allocate(
        cls,
        max_slots: int,
        spec: ModelSpec,
        device: torch.device | str = "cpu",
        extra_columns: dict[str, ColumnSpec] | None = None,
    ) -> "SlotTable":
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        device = torch.device(device)
        h, q, c = spec.hidden_size, spec.frame_width, spec.max_context
        r = max_slots + 1  # the last row is scratch: padding rows read and write it, inertly

        def col(shape=(), dtype=torch.int64):
            return torch.zeros((r, *shape), dtype=dtype, device=device)

        table = cls(
            max_slots=max_slots, max_context=c, num_codebooks=q, hidden_size=h, device=device,
            progress=torch.zeros((len(BLOCKS["progress"]), r), dtype=torch.int64, device=device),
            frame_embed=col((h,), spec.dtype), frame_codes=col((q,)), frame_log=col((c, q)), seed=col(),
            cb0_temperature=col(dtype=torch.float32), cb0_top_k=col(), cb0_top_p=col(dtype=torch.float32),
            mtp_temperature=col(dtype=torch.float32), mtp_top_k=col(), mtp_top_p=col(dtype=torch.float32),
            cb0_penalty=col(dtype=torch.float32) + 1.0, min_frames=col(),  # 1.0: no penalty (scratch row too)
            cb0_counts=col((spec.backbone_vocab_size,), torch.int32),
            prompt_embeds=col((c, h), spec.dtype), lifecycle_words=torch.zeros((len(BLOCKS["lifecycle_words"]), r), dtype=torch.int32, device=device),
            cb0_penalty_order=spec.repetition_penalty_order,
        )
        for name, cs in (extra_columns or {}).items():
            if name in table.columns():
                raise ValueError(f"model column {name!r} clashes with a core slot-table column")
            table.extra[name] = torch.full((r, *cs.shape), cs.fill, dtype=cs.dtype, device=device)
            table.extra_fill[name] = cs.fill
        return table

    def columns(self) -> dict[str, torch.Tensor]:
        """Every per-slot tensor (core and model columns) by name (a block is its columns, not one)."""
        core = {
            f.name: getattr(self, f.name)
            for f in attrs.fields(type(self))
            if isinstance(getattr(self, f.name), torch.Tensor) and f.name not in BLOCKS
        }
        return {**core, **self.extra}

    def column_defaults(self) -> dict[str, float]:
        """What a freshly admitted row holds in each column unless admission sets it. The
        state (the admission trigger's destination) and the error word (cleared, or the
        illegal-admission bit) are written by the admission itself, so they have none."""
        owned_by_admission = ("state", "error")
        defaults = {name: self.extra_fill.get(name, 0.0) for name in self.columns() if name not in owned_by_admission}
        defaults["finish_reason"] = float(FinishReason.NONE)
        defaults["cb0_penalty"] = 1.0
        return defaults

    def clone(self, device: torch.device | str | None = None) -> "SlotTable":
        """A copy of every column (on `device`, default this table's), each block still one tensor."""
        device = self.device if device is None else torch.device(device)
        tensors = {f.name: getattr(self, f.name).to(device, copy=True) for f in attrs.fields(type(self))
                   if f.init and isinstance(getattr(self, f.name), torch.Tensor)}
        return attrs.evolve(self, device=device, extra={k: v.to(device, copy=True) for k, v in self.extra.items()},
                            extra_fill=dict(self.extra_fill), **tensors)

    def row(self, slot: int) -> dict[str, torch.Tensor]:
        """One slot's values (a copy), for debugging and tests."""
        return {name: t[slot].clone() for name, t in self.columns().items()}
