"""The committed diagrams and the README block are exactly what the spec renders today."""

from pathlib import Path

import pytest

from mtp_fsm.lifecycle import VARIANTS
from mtp_fsm.lifecycle.diagrams import dot_source, mermaid_source, readme_block, render_all

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_committed_diagrams_match_spec(variant):
    spec = VARIANTS[variant]()
    assert (ROOT / "diagrams" / f"{variant}.dot").read_text() == dot_source(spec), "run `make diagrams`"
    assert (ROOT / "diagrams" / f"{variant}.mmd").read_text() == mermaid_source(spec), "run `make diagrams`"
    assert (ROOT / "diagrams" / f"{variant}.svg").exists()


def test_readme_carries_the_current_diagram():
    assert readme_block(VARIANTS["mtp"]()) in (ROOT / "README.md").read_text(), "run `make diagrams`"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_declared_transition_is_drawn_with_its_guard(variant):
    """Each edge appears with its trigger and guard (parallel edges share one arrow, `a | b`)."""
    spec = VARIANTS[variant]()
    drawn: dict[tuple[str, str], set[str]] = {}
    for line in mermaid_source(spec).splitlines():
        arrow, _, label = line.strip().partition(": ")
        if " --> " in arrow and label:
            source, dest = arrow.split(" --> ")
            drawn.setdefault((source, dest), set()).update(label.split(" | "))
    want: dict[tuple[str, str], set[str]] = {}
    for t in spec.transitions:
        guarded = t.guard is not None and t.guard.predicates
        label = f"{t.trigger.label} [{t.guard.describe()}]" if guarded else t.trigger.label
        for source in t.sources:
            want.setdefault((source.label, t.dest.label), set()).add(label)
    assert drawn == want


def test_sources_render_without_the_dot_binary(tmp_path):
    written = render_all(tmp_path, svg=False)
    assert {p.suffix for p in written} == {".dot", ".mmd"}
