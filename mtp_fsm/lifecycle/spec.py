"""The lifecycle declared once as a `transitions` machine: states, triggers, variants."""

from __future__ import annotations

import enum
from typing import Iterable

import attrs
from transitions import Machine


class State(enum.IntEnum):
    """Every state a request (or the slot row holding it) can be in; codes are stable."""

    FREE = 0  # slot row owned by no request
    WAITING = 1  # admitted, row initialised, no prompt token computed
    PREFILLING = 2  # part of the prompt computed (chunked prefill)
    DECODING = 3  # prompt complete; next input = cached frame embedding + text step
    SAMPLED = 4  # within a step: CB0 sampled and kept
    FRAME_READY = 5  # within a step: all Q codebooks of the frame are known
    FINISHED = 6  # terminal: eos or length
    ABORTED = 7  # terminal: client cancel or error
    PREEMPTED = 8  # slot released, resumable

    @property
    def label(self) -> str:
        return self.name.lower()


class Trigger(enum.IntEnum):
    """Every trigger of the lifecycle; codes index the compiled transition table."""

    ADMIT = 0
    PREFILL = 1  # a non-final prefill chunk was computed
    SAMPLE = 2  # final prefill chunk or decode row: CB0 sampled and kept
    EOS = 3  # the sampled CB0 is the codec EOS: no frame
    MTP = 4  # the MTP stage filled codebooks 1..Q-1
    PUBLISH = 5  # the frame was written to the step output
    FINISH_LENGTH = 6  # frame budget or context exhausted after a publish
    OVERRUN = 7  # a terminal row scheduled once more (async scheduling): publishes nothing
    PREEMPT = 8
    RESUME = 9
    ABORT = 10
    RELEASE = 11

    @property
    def label(self) -> str:
        return self.name.lower()


class FinishReason(enum.IntEnum):
    NONE = 0
    EOS = 1
    LENGTH = 2
    STOP = 3
    ABORT = 4
    ERROR = 5

    @property
    def label(self) -> str:
        return self.name.lower()


# Triggers the host fires between steps; everything else fires inside the step kernels.
HOST_TRIGGERS = frozenset({Trigger.ADMIT, Trigger.PREEMPT, Trigger.RESUME, Trigger.ABORT, Trigger.RELEASE})
TERMINAL_STATES = frozenset({State.FINISHED, State.ABORTED})
LIVE_STATES = frozenset({State.WAITING, State.PREFILLING, State.DECODING})
# States a row may rest in between steps; SAMPLED and FRAME_READY exist only inside a step.
RESTING_STATES = frozenset(State) - {State.SAMPLED, State.FRAME_READY}

_S, _T = State, Trigger


@attrs.frozen
class Transition:
    trigger: Trigger
    sources: tuple[State, ...]
    dest: State


@attrs.frozen
class LifecycleSpec:
    """One lifecycle variant: its transitions and the `transitions` machine built from them."""

    name: str
    title: str
    transitions: tuple[Transition, ...]

    @property
    def states(self) -> tuple[State, ...]:
        used = {s for t in self.transitions for s in (*t.sources, t.dest)}
        return tuple(s for s in State if s in used)

    @property
    def triggers(self) -> tuple[Trigger, ...]:
        used = {t.trigger for t in self.transitions}
        return tuple(t for t in Trigger if t in used)

    def build_machine(self, machine_cls: type[Machine] = Machine, model=None, **kwargs) -> Machine:
        """The single source of truth: a static machine (model=None) over these transitions.

        Diagrams pass a GraphMachine class and a throwaway model (graphs hang off models).
        """
        return machine_cls(
            model=model,
            states=[s.label for s in self.states],
            transitions=[
                {"trigger": t.trigger.label, "source": [s.label for s in t.sources], "dest": t.dest.label}
                for t in self.transitions
            ],
            initial=State.FREE.label,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            **kwargs,
        )


def _common(preemptible: Iterable[State]) -> list[Transition]:
    live = tuple(preemptible)
    return [
        Transition(_T.ADMIT, (_S.FREE,), _S.WAITING),
        Transition(_T.PREFILL, (_S.WAITING, _S.PREFILLING), _S.PREFILLING),
        Transition(_T.SAMPLE, (_S.WAITING, _S.PREFILLING, _S.DECODING), _S.SAMPLED),
        Transition(_T.EOS, (_S.SAMPLED,), _S.FINISHED),
        Transition(_T.PUBLISH, (_S.FRAME_READY,), _S.DECODING),
        Transition(_T.FINISH_LENGTH, (_S.DECODING,), _S.FINISHED),
        Transition(_T.OVERRUN, (_S.FINISHED,), _S.FINISHED),
        Transition(_T.OVERRUN, (_S.ABORTED,), _S.ABORTED),
        Transition(_T.PREEMPT, live, _S.PREEMPTED),
        Transition(_T.RESUME, (_S.PREEMPTED,), _S.WAITING),
        # Also fired inside a step: a row whose CB0 logits are non-finite ends with reason error.
        Transition(_T.ABORT, (*live, _S.PREEMPTED), _S.ABORTED),
        # Releasing a preempted row frees its slot; the request itself stays preempted.
        Transition(_T.RELEASE, (_S.FINISHED, _S.ABORTED, _S.PREEMPTED), _S.FREE),
    ]


def mtp_lifecycle() -> LifecycleSpec:
    """Generic current-step MTP: CB0 from the backbone, codebooks 1..Q-1 from the MTP hook."""
    transitions = _common(LIVE_STATES_ORDERED)
    transitions.insert(4, Transition(_T.MTP, (_S.SAMPLED,), _S.FRAME_READY))
    # A row whose MTP logits are non-finite ends with reason error in the MTP stage.
    transitions.append(Transition(_T.ABORT, (_S.SAMPLED,), _S.ABORTED))
    return LifecycleSpec("mtp", "Current-step MTP talker (Qwen3-TTS, Qwen3-Omni)", tuple(transitions))


def single_codebook_lifecycle() -> LifecycleSpec:
    """No MTP stage: the sampled CB0 is the whole frame (Chatterbox-style)."""
    transitions = [
        Transition(_T.SAMPLE, t.sources, _S.FRAME_READY) if t.trigger is _T.SAMPLE else t
        for t in _common(LIVE_STATES_ORDERED)
    ]
    # EOS is decided on the sampled token, which now lands in FRAME_READY directly.
    transitions = [Transition(_T.EOS, (_S.FRAME_READY,), _S.FINISHED) if t.trigger is _T.EOS else t for t in transitions]
    return LifecycleSpec("single_codebook", "Single-codebook talker without MTP (Chatterbox)", tuple(transitions))


LIVE_STATES_ORDERED = (State.WAITING, State.PREFILLING, State.DECODING)

VARIANTS = {"mtp": mtp_lifecycle, "single_codebook": single_codebook_lifecycle}


def lifecycle_for(name: str) -> LifecycleSpec:
    try:
        return VARIANTS[name]()
    except KeyError:
        raise ValueError(f"unknown lifecycle variant {name!r}; known: {sorted(VARIANTS)}") from None
