"""Triton backend: the stage functions of `reference`, same names, signatures and contract.

Each stage is one fused kernel launch over all rows (the phase's predicates, the compiled
stage chains run by one generic executor, data movement); launches never depend on the
batch size. Each stage's kernels sit beside their launcher in one module:

| stage             | module          | launches                                                 |
|-------------------|-----------------|----------------------------------------------------------|
| apply_host_events | triton_events   | 1                                                        |
| apply_admits      | triton_events   | 1 per element width among the columns (<= 4)             |
| replay_frames     | triton_events   | 1 (+ the model's frame_embed and text_step)              |
| compose_inputs    | triton_compose  | 2: frame index, then the fused gather (+ text_step)      |
| sample_cb0        | triton_sample   | 1                                                        |
| mtp_sampler       | triton_sample   | 1 memset (fault words) + 1 per codebook the hook samples |
| mtp_scatter       | triton_sample   | 1                                                        |
| publish_frames    | triton_publish  | 1                                                        |
| sample_positions  | triton_verify   | 1 (speculative: every verify position of every row)      |
| verify_frames     | triton_verify   | 1 (speculative: each row's positions walked in order)    |

Shared by all: `triton_common` (the generic chain executor and the table layout as
constexprs), `triton_sampling` (the batch-invariant sampler), `triton_launch` (tiles,
blocks and constexprs on the host side).

Each kernel computes its phase's predicates, runs the compiled stage chains of that phase
through the generic executor (`triton_common.run_stage`: rules gathered at the row's state,
guard masks on the predicate word) and moves the data the fired rules call for. No kernel
names a trigger or a state: the lifecycle arrives as tensors (rules, state classes,
chains), and chain shapes and table strides are the only constexprs taken from it, so a
kernel compiles once per lifecycle variant. Padding rows (is_padding, pointing at the
scratch row) compute like any row but never write the table: the reference's writes for
them store the values they already hold, so skipping them is exact and race-free. Row and
token counts are not specialised on (do_not_specialize), so a new batch size never
recompiles.

A decode step is 6 launches plus Q - 1 MTP sampling launches. No stage reads a device
value on the host, and no decode stage builds a tensor from host data (admission uploads its
pointer tables through pinned memory), so the decode stages can be captured in a CUDA graph
(after a warm-up launch has compiled them). Kernels process tiles of rows: one row
(sampling) or a few per program on a GPU, the whole batch in one program under the CPU
interpreter (TRITON_INTERPRET=1, set before triton is first imported), whose per-program
cost is large.
"""

from __future__ import annotations

# The backend's namespace: every stage function, the packed output layout, what it can run on.
# Importing a stage module raises ImportError when Triton is missing: the backend selector reports it.
from . import triton_compose, triton_events, triton_publish, triton_sample, triton_verify
from .contract import (  # noqa: F401
    OUT_CODES, OUT_ERROR, OUT_FRAME_INDEX, OUT_NUM_FRAMES, OUT_REASON, OUT_STATE, OUT_VALID,
)
from .triton_compose import compose_inputs  # noqa: F401
from .triton_events import apply_admits, apply_host_events, replay_frames  # noqa: F401
from .triton_launch import interpreted, unsupported  # noqa: F401
from .triton_publish import publish_frames  # noqa: F401
from .triton_sample import mtp_sampler, mtp_scatter, sample_cb0  # noqa: F401
from .triton_verify import sample_positions, verify_frames  # noqa: F401

# No stage reads a device value on the host: a decode step can be captured as a CUDA graph
# (engine/decode_graphs.py; the torch reference's candidate sampler reads one on purpose).
CUDA_GRAPHS = True

# The stage modules, for tools that look at every Triton kernel (gpu_check's launch counts).
STAGE_MODULES = (triton_events, triton_compose, triton_sample, triton_publish, triton_verify)
