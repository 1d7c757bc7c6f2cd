"""Token-major view of a step's frames, the layout a vLLM runner's retained outputs use."""

from __future__ import annotations

import attrs
import torch

from ..engine.plan import StepOutput


@attrs.frozen
class TokenMajorFrames:
    """codes[T, Q] and valid[T]: a frame sits at the last token of its row's span
    (`query_start_loc[i + 1] - 1`); every other token (prefill chunks that did not
    finish the prompt, padding, rows that produced no frame) stays invalid and zero."""

    codes: torch.Tensor  # int64 [T, Q]
    valid: torch.Tensor  # bool [T]
    request_ids: tuple[str | None, ...]  # per token: the owning request (None for padding)


def to_token_major(output: StepOutput, num_tokens: int | None = None) -> TokenMajorFrames:
    """Scatter the step's request-major frames to token rows.

    num_tokens: pad the token axis to this size (a CUDA-graph bucket); extra rows are invalid.
    """
    rows = output.rows
    qsl = rows.query_start_loc
    total = int(qsl[-1]) if num_tokens is None else num_tokens
    if total < int(qsl[-1]):
        raise ValueError(f"num_tokens={total} is smaller than the step's {int(qsl[-1])} scheduled tokens")
    q = rows.codes.shape[1]
    codes = torch.zeros(total, q, dtype=torch.int64)
    valid = torch.zeros(total, dtype=torch.bool)
    kept = rows.valid & (qsl[1:] > qsl[:-1])
    last = (qsl[1:] - 1)[kept]
    codes[last] = rows.codes[kept]
    valid[last] = True
    counts = (qsl[1:] - qsl[:-1]).tolist()
    owners: list[str | None] = []
    for rid, n in zip(rows.request_ids, counts):
        owners += [rid] * n
    owners += [None] * (total - len(owners))
    return TokenMajorFrames(codes, valid, tuple(owners))
