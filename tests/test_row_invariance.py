"""Every talker's hooks are row-invariant bit for bit on this machine (TalkerModel contract, DESIGN 2.5.1):
each hook call of a real engine run, replayed on the first B rows (B = 1..N), on each row alone,
reversed and padded, gives each row the same bits; and the probe catches a hook that is not."""

from __future__ import annotations

import pytest
import torch

from mtp_fsm import invariant
from mtp_fsm.testing.determinism import WORKLOADS, run
from mtp_fsm.testing.row_invariance import RowInvarianceProbe, row_subsets, same_bits
from mtp_fsm.testing.scripted import ScriptedTalker


@pytest.mark.parametrize("name", WORKLOADS)
def test_hooks_are_row_invariant(name):
    result = run(name)
    assert result["problems"] == []
    calls = result["batched_calls"]
    hooks = {"forward", "cb0_logits", "frame_embed", "text_step"}
    hooks |= {"mtp"} if not name.startswith(("chatterbox", "mtp_lm", "scripted_single")) else set()
    hooks |= {"draft"} if name.endswith("_speculative") else set()
    assert hooks <= {h for h, n in calls.items() if n > 0}, f"hooks never called with 2+ rows: {calls}"


class BatchSizeDependent(ScriptedTalker):
    """cb0_logits nudged by the batch size: what a BLAS path that picks kernels by shape does."""

    def cb0_logits(self, hidden):
        logits = super().cb0_logits(hidden)
        return logits + 1e-12 * (hidden.shape[0] > 1)


def test_the_probe_reports_a_hook_whose_rows_depend_on_the_batch():
    from mtp_fsm.engine import LockstepEngine, NewRequest
    from mtp_fsm.testing.scripted import ScriptInputs

    model = BatchSizeDependent()
    probe = RowInvarianceProbe(model)
    engine = LockstepEngine(model, 3, kernels="torch")
    engine.generate([NewRequest(f"r{i}", ScriptInputs(prompt=(1, 2, 3 + i)), max_frames=3) for i in range(3)])
    probe.close()
    assert probe.problems and all("cb0_logits" in p for p in probe.problems)
    assert "forward" not in " ".join(probe.problems)


def test_row_subsets_cover_every_batch_size_and_row():
    subsets = row_subsets(4)
    assert [list(range(b)) for b in range(1, 5)] == subsets[:4]
    assert {r for s in subsets if len(s) == 1 for r in s} == {0, 1, 2, 3}
    assert [3, 2, 1, 0] in subsets


def test_same_bits_sees_signed_zeros_and_nan_payloads():
    assert same_bits(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same_bits(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 64])
def test_invariant_linear_rows_equal_alone_and_batched(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 6, generator=g, dtype=torch.float64)
    w = torch.randn(6, 16, generator=g, dtype=torch.float64)  # the shape of the EPYC failure
    full = invariant.matmul(x, w)
    for i in range(rows):
        assert same_bits(invariant.matmul(x[i:i + 1], w)[0], full[i])
    assert torch.allclose(full, x @ w, rtol=1e-12, atol=1e-12)
