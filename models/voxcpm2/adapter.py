"""VoxCPM2Talker: VoxCPM2 as an mtp_fsm TalkerModel (stop head as CB0, the DiT patch as the frame payload)."""

from __future__ import annotations

import attrs
import torch

from mtp_fsm.model_api import ColumnSpec, FrameDraws, ModelSpec, PayloadSpec, PreparedPrompt, TalkerModel
from mtp_fsm.sampling import GREEDY

from .config import VoxCPM2Config
from .core import STOP_TOKEN, VoxCPM2Core

# The slot column holding each request's text prompt length: positions at or past it carry
# patches (audio rows: FSQ bottleneck, patch embedding into the residual LM).
PROMPT_LEN = "prompt_len0"


@attrs.frozen
class VoxCPM2Inputs:
    """A zero-shot request: text (tokenized by the model's tokenizer) or its ids."""

    text: str | None = None
    text_ids: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))

    def __attrs_post_init__(self) -> None:
        if (self.text is None) == (self.text_ids is None):
            raise ValueError("VoxCPM2Inputs needs exactly one of text and text_ids")


class VoxCPM2Talker(VoxCPM2Core, TalkerModel):
    """VoxCPM2 driven by the lockstep engine under the `stop_head` lifecycle.

    Engine mapping, in upstream `_inference` order: the backbone `forward` runs the base LM
    (FSQ on audio rows) and the residual LM; "CB0" is the 2-way stop head, sampled greedily
    (the model's own sampling: argmax, ties to 0), EOS = class 1, masked for the first
    min_len + 1 patches (upstream stops only when the step index exceeds min_len); the MTP
    stage is the local DiT's CFM solve, whose patch is the frame payload [patch, feat] and is
    published also on the stop step. The DiT's initial noise is the engine's per-row
    Gaussian draw (keyed by the request seed and frame index) and its prefix patch is the
    row's previous payload, both from FrameDraws: patches never depend on the batch, and a
    resumed request reproduces them bit for bit. The next input is `next_embed(patch)`.
    """

    def __init__(self, config: VoxCPM2Config, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", init_weights: bool = True):
        super().__init__(config, seed=seed, dtype=dtype, device=device, init_weights=init_weights)
        self._columns: dict[str, torch.Tensor] = {}
        self._spec = ModelSpec(
            name="voxcpm2", hidden_size=config.hidden_size, num_codebooks=1, backbone_vocab_size=2,
            codebook_size=1, eos_token_id=STOP_TOKEN, max_context=config.max_context, dtype=dtype,
            variant="stop_head", cb0_sampling=GREEDY, mtp_sampling=GREEDY, min_frames=config.min_len + 1,
            forward_width=2 * config.hidden_size,
            payload=PayloadSpec((config.patch_size, config.feat_dim), dtype),
        )

    @property
    def spec(self) -> ModelSpec:  # type: ignore[override]
        return self._spec

    # ---------------------------------------------------------------- admission

    @torch.no_grad()
    def prepare(self, inputs: VoxCPM2Inputs) -> PreparedPrompt:
        """The text prompt's base LM rows [P, H] (ending with the audio-start token) and its length."""
        if not isinstance(inputs, VoxCPM2Inputs):
            raise ValueError(f"VoxCPM2 takes VoxCPM2Inputs, got {type(inputs).__name__}")
        ids = list(inputs.text_ids) if inputs.text_ids is not None else self.tokenize(inputs.text)
        if not ids:
            raise ValueError("an empty prompt: VoxCPM2 needs at least the audio-start token")
        vocab = self.config.lm_config.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise ValueError(f"text ids outside the vocabulary [0, {vocab})")
        if len(ids) >= self.config.max_context:
            raise ValueError(f"prompt of {len(ids)} positions leaves no room in max_context {self.config.max_context}")
        embeds = self.prompt_embeds(torch.tensor(ids, dtype=torch.long, device=self.device))
        return PreparedPrompt(prompt_embeds=embeds, columns={PROMPT_LEN: torch.tensor(len(ids))})

    def slot_columns(self) -> dict[str, ColumnSpec]:
        return {PROMPT_LEN: ColumnSpec((), torch.int64, 0.0)}

    def bind_slots(self, max_slots: int, device: torch.device, columns: dict[str, torch.Tensor] | None = None) -> None:
        super().bind_slots(max_slots, device, columns)
        self._columns = columns or {}

    # ---------------------------------------------------------------- step hooks

    def text_step(self, columns: dict[str, torch.Tensor], slots: torch.Tensor,
                  frame_index: torch.Tensor) -> torch.Tensor:
        """Zeros [B, H]: the text conditions the patches only through the prompt."""
        return torch.zeros(slots.shape[0], self.config.hidden_size, dtype=self.dtype, device=slots.device)

    @torch.no_grad()
    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                token_slots: torch.Tensor) -> torch.Tensor:
        """[T, 2H]: rows at or past their request's text prompt carry patches (also replayed ones)."""
        prompt_len = self._columns[PROMPT_LEN]
        rows = torch.where(token_slots >= 0, token_slots, prompt_len.shape[0] - 1)
        return super().forward(inputs_embeds, positions, token_slots, positions >= prompt_len[rows])

    @torch.no_grad()
    def cb0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.stop_logits(hidden)

    @torch.no_grad()
    def mtp(self, hidden: torch.Tensor, cb0: torch.Tensor, sample: FrameDraws) -> torch.Tensor:  # type: ignore[override]
        """The frame payload: the CFM patch [B, patch, feat] from the same hidden state."""
        shape = (self.config.patch_size, self.config.feat_dim)
        return self.patch(hidden, sample.previous, sample.normal(shape))

    @torch.no_grad()
    def frame_embed(self, codes: torch.Tensor) -> torch.Tensor:
        """The payload (a patch [B, patch, feat]) -> the next base LM input [B, H]."""
        return self.next_embed(codes)
