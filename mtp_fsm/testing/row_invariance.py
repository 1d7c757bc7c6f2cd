"""Row invariance of a talker's hooks: each call of a real engine run replayed on row subsets, bit for bit.

`RowInvarianceProbe(model)` wraps the model's hooks (forward, cb0_logits, mtp, frame_embed,
text_step, draft). After every real call it replays the call on the first B rows
(B = 1..N), on each row alone, on the rows reversed and (forward) with a padding token
added, and records a problem wherever a row's output bits differ from the same row in the
full call. The MTP hook's sampler and the drafter's chooser are replayed from what the real
call drew, and the logits they are handed are compared too, so the check covers every
per-row result that decides a token or is published, at the shapes the talker really uses.
Replays happen inside the real call, before anything else touches the model's state (a
forward replay rewrites the same KV entries with the same values).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import attrs
import torch

from ..model_api import DraftInputs, FrameDraws, MtpResult, TalkerModel

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, dtypes and bits (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        a, b = a.contiguous().view(_INT_VIEW[a.dtype.itemsize]), b.contiguous().view(_INT_VIEW[b.dtype.itemsize])
    return torch.equal(a, b)


def row_subsets(n: int) -> list[list[int]]:
    """Prefixes 1..n, each other row alone, and all rows reversed."""
    subsets = [list(range(b)) for b in range(1, n + 1)]
    subsets += [[i] for i in range(1, n)]
    if n > 1:
        subsets.append(list(range(n - 1, -1, -1)))
    return subsets


@attrs.define
class _Recorded:
    """What a sampler / chooser handed out in the real call, in call order."""

    calls: list[tuple[torch.Tensor, torch.Tensor]] = attrs.field(factory=list)  # (logits, tokens)
    normals: list[torch.Tensor] = attrs.field(factory=list)


class RowInvarianceProbe:
    """Wraps `model`'s hooks in place; `problems` lists every row whose bits changed."""

    HOOKS = ("forward", "cb0_logits", "mtp", "frame_embed", "text_step", "draft")

    def __init__(self, model: TalkerModel, max_rows: int = 8) -> None:
        self.model, self.max_rows = model, max_rows
        self.problems: list[str] = []
        self.calls: Counter = Counter()  # hook -> real calls with >= 2 rows
        self._originals: dict[str, Callable] = {}
        for name in self.HOOKS:
            if name == "mtp" and not model.spec.has_mtp or name == "draft" and not model.can_draft:
                continue
            self._originals[name] = getattr(model, name)
            setattr(model, name, getattr(self, f"_{name}"))

    def close(self) -> None:
        for name in self._originals:
            delattr(self.model, name)

    # -- comparison ---------------------------------------------------------------------

    def _compare(self, hook: str, full: Any, rows: list[int], part: Any, what: str = "output") -> None:
        if isinstance(full, MtpResult):
            self._compare(hook, full.codes, rows, part.codes, "codes")
            self._compare(hook, full.stop, rows, part.stop, "stop")
            return
        want = full[rows]
        if not same_bits(want, part):
            diff = [r for i, r in enumerate(rows) if i < len(part) and not same_bits(want[i], part[i])]
            self.problems.append(f"{self.model.spec.name}.{hook}: rows {diff or rows} of a {len(full)}-row call "
                                 f"give other {what} bits when the call has rows {rows}")

    def _replay_all(self, hook: str, n: int, full: Any, replay: Callable[[list[int]], Any]) -> None:
        if n >= 2:
            self.calls[hook] += 1
        for rows in row_subsets(min(n, self.max_rows)):
            self._compare(hook, full, rows, replay(rows))

    # -- samplers replayed from the real call --------------------------------------------

    def _recording(self, sample, record: _Recorded):
        def draw(logits, *args):
            tokens = sample(logits, *args)
            record.calls.append((logits.clone(), tokens.clone()))
            return tokens
        if isinstance(sample, FrameDraws):
            def normal(shape):
                noise = sample.normal(shape)
                record.normals.append(noise.clone())
                return noise
            return FrameDraws(draw, normal, sample.previous)
        return draw

    def _replaying(self, hook: str, sample, record: _Recorded, rows: list[int]):
        calls, normals = iter(record.calls), iter(record.normals)

        def draw(logits, *args):
            full_logits, tokens = next(calls)
            self._compare(hook, full_logits, rows, logits, "sampler logits")
            return tokens[rows]
        if isinstance(sample, FrameDraws):
            return FrameDraws(draw, lambda shape: next(normals)[rows], sample.previous[rows])
        return draw

    # -- the hooks -----------------------------------------------------------------------

    def _forward(self, inputs_embeds, positions, token_slots):
        original = self._originals["forward"]
        full = original(inputs_embeds, positions, token_slots)
        out = full.clone()

        def replay(rows):
            return original(inputs_embeds[rows], positions[rows], token_slots[rows])
        self._replay_all("forward", len(positions), out, replay)
        # One padding token (slot -1) beside the real ones changes none of them.
        padded = original(torch.cat([inputs_embeds, inputs_embeds[:1]]), torch.cat([positions, positions[:1]]),
                          torch.cat([token_slots, torch.full_like(token_slots[:1], -1)]))
        self._compare("forward", out, list(range(len(positions))), padded[: len(positions)], "output (padded)")
        return full

    def _per_row(self, hook: str, *args, shared: tuple = ()):
        """A hook whose arguments (after `shared` ones) are all per row: replayed on row subsets."""
        original = self._originals[hook]
        full = original(*shared, *args)
        self._replay_all(hook, len(args[0]), full, lambda rows: original(*shared, *(a[rows] for a in args)))
        return full

    def _cb0_logits(self, hidden):
        return self._per_row("cb0_logits", hidden)

    def _text_step(self, columns, slots, frame_index):
        return self._per_row("text_step", slots, frame_index, shared=(columns,))

    def _frame_embed(self, codes):
        return self._per_row("frame_embed", codes)

    def _mtp(self, hidden, cb0, sample):
        original, record = self._originals["mtp"], _Recorded()
        full = original(hidden, cb0, self._recording(sample, record))

        def replay(rows):
            return original(hidden[rows], cb0[rows], self._replaying("mtp", sample, record, rows))
        self._replay_all("mtp", len(cb0), full, replay)
        return full

    def _draft(self, inputs: DraftInputs, choose):
        original, record = self._originals["draft"], _Recorded()
        full = original(inputs, self._recording(choose, record))

        def replay(rows):
            sub = attrs.evolve(inputs, last=inputs.last[rows], chain_positions=inputs.chain_positions[rows],
                               chain_slots=inputs.chain_slots[rows])
            return original(sub, self._replaying("draft", choose, record, rows))
        self._replay_all("draft", len(inputs.last), full, replay)
        return full
