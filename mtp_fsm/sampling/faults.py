"""Sampling faults: why a logits row could not be sampled, as a small integer code.

Every sampler (the batched torch `sample_tokens`, the Triton kernels, the interpreter's
per-row reference) returns one fault code per row:

- FAULT_OK (0): the row was sampled normally;
- FAULT_NAN (1): some logit is NaN;
- FAULT_POSINF (2): some logit is +inf (and none is NaN);
- FAULT_EMPTY (3): every finite logit is masked: every id the `allowed` mask admits holds
  -inf, so no id is left to sample;
- FAULT_PAYLOAD (4): not a sampler's: the continuous payload an MTP hook returned (a model
  with ModelSpec.payload) holds a NaN or an infinity.
- FAULT_DRAFT (5): not a sampler's: a drafter's logits (speculative decoding) held a NaN or
  +inf, or left no allowed id; the word's codebook field is the draft's index.

A -inf logit is a mask (the id is never sampled, like an id outside `allowed`), not a
fault. The checks are made on the float32 logits (a float64 logit beyond the float32
range becomes +-inf first). When several apply, the lowest code wins (NaN, then +inf).

The slot table's `fault` column keeps the first fault that ended a request as one word,
`kind | (codebook << FAULT_CODEBOOK_SHIFT)` (codebook 0 = CB0, 1..Q-1 = MTP codebooks);
`describe_fault` turns such a word into a sentence.
"""

from __future__ import annotations

FAULT_OK = 0
FAULT_NAN = 1
FAULT_POSINF = 2
FAULT_EMPTY = 3
FAULT_PAYLOAD = 4
FAULT_DRAFT = 5

FAULT_CODEBOOK_SHIFT = 4
FAULT_KIND_MASK = (1 << FAULT_CODEBOOK_SHIFT) - 1



def fault_word(kind: int, codebook: int) -> int:
    """The packed word of a fault `kind` seen while sampling `codebook` (0 = CB0)."""
    return int(kind) | (int(codebook) << FAULT_CODEBOOK_SHIFT)


def fault_kind(word: int) -> int:
    return int(word) & FAULT_KIND_MASK


def fault_codebook(word: int) -> int:
    return int(word) >> FAULT_CODEBOOK_SHIFT


def describe_fault(word: int) -> str:
    """A sentence for a fault word (the `fault` column): the stage, the codebook and the
    value, e.g. "CB0 sampling: a logit is NaN", "MTP sampling, codebook 3: a logit is +inf"."""
    word = int(word)
    kind, codebook = fault_kind(word), fault_codebook(word)
    if word == FAULT_OK:
        return "ended in error by the lifecycle, no sampling fault recorded"
    if kind == FAULT_PAYLOAD:
        return "MTP stage: the frame payload holds a NaN or an infinity"
    if kind == FAULT_DRAFT:
        return f"drafter, draft {codebook}: a logit is NaN or +inf, or no allowed id is left"
    where = "CB0 sampling" if codebook == 0 else f"MTP sampling, codebook {codebook}"
    what = {
        FAULT_NAN: "a logit is NaN",
        FAULT_POSINF: "a logit is +inf",
        FAULT_EMPTY: "every allowed id is masked (-inf), nothing left to sample",
    }.get(kind, f"unknown fault kind {kind} (word {word})")
    return f"{where}: {what}"
