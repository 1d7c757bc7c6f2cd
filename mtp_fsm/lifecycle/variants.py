"""The declared lifecycle variants: where every trigger leads, when it fires, in which stage."""

from __future__ import annotations

import attrs

from .predicates import ALWAYS, Guard, Phase
from .spec import FinishReason, LifecycleSpec, Stage, State, StateClasses, Transition, Trigger

_S, _T = State, Trigger
_LIVE = (_S.WAITING, _S.PREFILLING, _S.DECODING)
_IN_PROMPT = (_S.WAITING, _S.PREFILLING)  # rows whose scheduled tokens may still be prompt

HOST_TRIGGERS = frozenset({_T.ADMIT, _T.PREEMPT, _T.RESUME, _T.ABORT, _T.RELEASE})

CLASSES = StateClasses(
    live=frozenset(_LIVE),
    terminal=frozenset({_S.FINISHED, _S.ABORTED}),
    in_step=frozenset({_S.SAMPLED, _S.FRAME_READY}),
    vacant=frozenset({_S.FREE}),
)


def _host_edges() -> list[Transition]:
    return [
        Transition(_T.ADMIT, (_S.FREE,), _S.WAITING),
        Transition(_T.PREEMPT, _LIVE, _S.PREEMPTED),
        Transition(_T.RESUME, (_S.PREEMPTED,), _S.WAITING),
        Transition(_T.ABORT, (*_LIVE, _S.PREEMPTED), _S.ABORTED),
        # Releasing a preempted row frees its slot; the request itself stays preempted.
        Transition(_T.RELEASE, (_S.FINISHED, _S.ABORTED, _S.PREEMPTED), _S.FREE),
    ]


def _intake(kept: State) -> list[Transition]:
    """What a scheduled row does once the backbone ran and CB0 was sampled."""
    done, bad = "prompt_done", "cb0_fault"
    return [
        Transition(_T.PREFILL, _IN_PROMPT, _S.PREFILLING, Guard(unless=(done,))),
        Transition(_T.SAMPLE, _IN_PROMPT, kept, Guard(when=(done,), unless=(bad,))),
        Transition(_T.SAMPLE, (_S.DECODING,), kept, Guard(unless=(bad,))),
        # Non-finite CB0 logits: the sample is never kept and the request ends with an error.
        Transition(_T.FAIL, _IN_PROMPT, _S.ABORTED, Guard(when=(done, bad)), FinishReason.ERROR),
        Transition(_T.FAIL, (_S.DECODING,), _S.ABORTED, Guard(when=(bad,)), FinishReason.ERROR),
        Transition(_T.OVERRUN, (_S.FINISHED,), _S.FINISHED, ALWAYS),
        Transition(_T.OVERRUN, (_S.ABORTED,), _S.ABORTED, ALWAYS),
    ]


def _publication() -> list[Transition]:
    return [
        Transition(_T.PUBLISH, (_S.FRAME_READY,), _S.DECODING, ALWAYS, publishes=True),
        # The next input would sit at position num_computed: stop when it no longer fits.
        Transition(_T.FINISH_LENGTH, (_S.DECODING,), _S.FINISHED, Guard(when=("length_reached",)), FinishReason.LENGTH),
    ]


_INTAKE_STAGE = Stage("intake", Phase.SAMPLE, (_T.PREFILL, _T.SAMPLE, _T.FAIL, _T.OVERRUN), total=True)
_EOS_STAGE = Stage("eos", Phase.SAMPLE, (_T.EOS,))
_PUBLISH_STAGES = (Stage("publish", Phase.PUBLISH, (_T.PUBLISH,)), Stage("length", Phase.PUBLISH, (_T.FINISH_LENGTH,)))


def mtp_lifecycle() -> LifecycleSpec:
    """Generic current-step MTP: CB0 from the backbone, codebooks 1..Q-1 from the MTP hook."""
    transitions = [
        *_host_edges(),
        *_intake(_S.SAMPLED),
        Transition(_T.EOS, (_S.SAMPLED,), _S.FINISHED, Guard(when=("eos_sampled",)), FinishReason.EOS),
        Transition(_T.MTP, (_S.SAMPLED,), _S.FRAME_READY, Guard(unless=("mtp_fault",))),
        Transition(_T.MTP_FAIL, (_S.SAMPLED,), _S.ABORTED, Guard(when=("mtp_fault",)), FinishReason.ERROR),
        *_publication(),
    ]
    stages = (_INTAKE_STAGE, _EOS_STAGE, Stage("mtp", Phase.MTP, (_T.MTP, _T.MTP_FAIL)), *_PUBLISH_STAGES)
    return LifecycleSpec(
        "mtp", "Current-step MTP talker (Qwen3-TTS, Qwen3-Omni)", tuple(transitions), stages, CLASSES, HOST_TRIGGERS
    )


def single_codebook_lifecycle() -> LifecycleSpec:
    """No MTP stage: the sampled CB0 is the whole frame (Chatterbox-style)."""
    transitions = [
        *_host_edges(),
        *_intake(_S.FRAME_READY),
        # EOS is decided on the sampled token, which lands in FRAME_READY directly.
        Transition(_T.EOS, (_S.FRAME_READY,), _S.FINISHED, Guard(when=("eos_sampled",)), FinishReason.EOS),
        *_publication(),
    ]
    stages = (_INTAKE_STAGE, _EOS_STAGE, *_PUBLISH_STAGES)
    return LifecycleSpec(
        "single_codebook", "Single-codebook talker without MTP (Chatterbox)", tuple(transitions), stages, CLASSES,
        HOST_TRIGGERS,
    )


def mtp_stop_lifecycle() -> LifecycleSpec:
    """The MTP stage decides the stop (MOSS-TTS Local: the local transformer returns
    (continue, codes)); CB0 never ends a request."""
    fault, stop = "mtp_fault", "mtp_stop"
    transitions = [
        *_host_edges(),
        *_intake(_S.SAMPLED),
        Transition(_T.MTP, (_S.SAMPLED,), _S.FRAME_READY, Guard(unless=(fault, stop))),
        Transition(_T.MTP_FAIL, (_S.SAMPLED,), _S.ABORTED, Guard(when=(fault,)), FinishReason.ERROR),
        # A stopped stream publishes no frame for this step and never emits again.
        Transition(_T.MTP_STOP, (_S.SAMPLED,), _S.FINISHED, Guard(when=(stop,), unless=(fault,)), FinishReason.EOS),
        *_publication(),
    ]
    stages = (_INTAKE_STAGE, Stage("mtp", Phase.MTP, (_T.MTP, _T.MTP_FAIL, _T.MTP_STOP)), *_PUBLISH_STAGES)
    return LifecycleSpec(
        "mtp_stop", "MTP stage decides the stop (MOSS-TTS Local)", tuple(transitions), stages, CLASSES, HOST_TRIGGERS,
    )


def mtp_stop_deferred_lifecycle() -> LifecycleSpec:
    """mtp_stop on the deferred schedule (MOSS-TTS Local's canonical path): the step that
    samples CB0 caches the hidden state and rests the row in `pending`; the next step first
    runs that frame's MTP and publishes it, then computes its own token. Same frames as
    mtp_stop, each one step later."""
    fault, stop, live = "mtp_fault", "mtp_stop", (*_LIVE, _S.PENDING)
    transitions = [
        Transition(_T.ADMIT, (_S.FREE,), _S.WAITING),
        Transition(_T.PREEMPT, live, _S.PREEMPTED),
        Transition(_T.RESUME, (_S.PREEMPTED,), _S.WAITING),
        Transition(_T.ABORT, (*live, _S.PREEMPTED), _S.ABORTED),
        Transition(_T.RELEASE, (_S.FINISHED, _S.ABORTED, _S.PREEMPTED), _S.FREE),
        Transition(_T.MTP, (_S.PENDING,), _S.FRAME_READY, Guard(unless=(fault, stop))),
        Transition(_T.MTP_FAIL, (_S.PENDING,), _S.ABORTED, Guard(when=(fault,)), FinishReason.ERROR),
        Transition(_T.MTP_STOP, (_S.PENDING,), _S.FINISHED, Guard(when=(stop,), unless=(fault,)), FinishReason.EOS),
        *_publication(),
        *_intake(_S.PENDING),
    ]
    stages = (Stage("mtp", Phase.MTP, (_T.MTP, _T.MTP_FAIL, _T.MTP_STOP)), *_PUBLISH_STAGES, _INTAKE_STAGE)
    classes = attrs.evolve(CLASSES, live=CLASSES.live | {_S.PENDING}, in_step=frozenset({_S.FRAME_READY}))
    return LifecycleSpec(
        "mtp_stop_deferred", "MTP-decided stop on the deferred schedule (MOSS-TTS Local canonical)",
        tuple(transitions), stages, classes, HOST_TRIGGERS, phase_order=(Phase.MTP, Phase.PUBLISH, Phase.SAMPLE),
    )


def conditioned_lifecycle() -> LifecycleSpec:
    """Current-step MTP whose text step reads an external conditioning feed (Qwen3-Omni
    thinker rows): a decoding request whose next row has not arrived rests in `starved`."""
    transitions = [
        *(t for t in mtp_lifecycle().transitions if t.trigger not in (_T.PREEMPT, _T.ABORT)),
        Transition(_T.PREEMPT, (*_LIVE, _S.STARVED), _S.PREEMPTED),
        Transition(_T.ABORT, (*_LIVE, _S.PREEMPTED, _S.STARVED), _S.ABORTED),
        Transition(_T.STARVE, (_S.DECODING,), _S.STARVED),
        Transition(_T.FEED, (_S.STARVED,), _S.DECODING),
    ]
    return LifecycleSpec(
        "conditioned", "Current-step MTP with an external conditioning feed (Qwen3-Omni)", tuple(transitions),
        mtp_lifecycle().stages, CLASSES, HOST_TRIGGERS | {_T.STARVE, _T.FEED},
    )


def delay_pattern_lifecycle() -> LifecycleSpec:
    """A frame of Q codebooks sampled together under a MusicGen-style delay pattern (Higgs
    Audio v3): ramp-up, normal decoding and the EOC wind-down are resting states, and where
    a published frame leads is decided by the frame itself (its index, its EOC codes).

    Every frame is published, fillers included; codebook 0's EOC does not end the request,
    the frame Q-1 frames later does (reason eos): as upstream (boson-multimodal's
    `_sample_audio_tokens`, vllm-omni's Higgs v3), wind-down frame e + j holds EOC on
    codebooks 0..j-1, so the last one, e + Q - 1, keeps codebook Q-1's real code. The MTP stage is the fused head's
    codebooks 1..Q-1 (sampled from the same hidden state, no extra forward)."""
    ramp, wind, done, eoc, full = _S.RAMP_UP, _S.WIND_DOWN, "ramp_done", "eoc_frame", "wind_done"
    live, decoding = (*_LIVE, ramp, wind), (_S.DECODING, ramp, wind)
    bad = "cb0_fault"
    transitions = [
        Transition(_T.ADMIT, (_S.FREE,), _S.WAITING),
        Transition(_T.PREEMPT, live, _S.PREEMPTED),
        Transition(_T.RESUME, (_S.PREEMPTED,), _S.WAITING),
        Transition(_T.ABORT, (*live, _S.PREEMPTED), _S.ABORTED),
        Transition(_T.RELEASE, (_S.FINISHED, _S.ABORTED, _S.PREEMPTED), _S.FREE),
        Transition(_T.PREFILL, _IN_PROMPT, _S.PREFILLING, Guard(unless=("prompt_done",))),
        Transition(_T.SAMPLE, _IN_PROMPT, _S.SAMPLED, Guard(when=("prompt_done",), unless=(bad,))),
        Transition(_T.SAMPLE, decoding, _S.SAMPLED, Guard(unless=(bad,))),
        Transition(_T.FAIL, _IN_PROMPT, _S.ABORTED, Guard(when=("prompt_done", bad)), FinishReason.ERROR),
        Transition(_T.FAIL, decoding, _S.ABORTED, Guard(when=(bad,)), FinishReason.ERROR),
        Transition(_T.OVERRUN, (_S.FINISHED,), _S.FINISHED, ALWAYS),
        Transition(_T.OVERRUN, (_S.ABORTED,), _S.ABORTED, ALWAYS),
        Transition(_T.MTP, (_S.SAMPLED,), _S.FRAME_READY, Guard(unless=("mtp_fault",))),
        Transition(_T.MTP_FAIL, (_S.SAMPLED,), _S.ABORTED, Guard(when=("mtp_fault",)), FinishReason.ERROR),
        Transition(_T.RAMP, (_S.FRAME_READY,), ramp, Guard(unless=(done, eoc)), publishes=True),
        Transition(_T.PUBLISH, (_S.FRAME_READY,), _S.DECODING, Guard(when=(done,), unless=(eoc,)), publishes=True),
        Transition(_T.WIND, (_S.FRAME_READY,), wind, Guard(when=(eoc,)), publishes=True),
        Transition(_T.WOUND_DOWN, (wind,), _S.FINISHED, Guard(when=(full,)), FinishReason.EOS),
        Transition(_T.FINISH_LENGTH, (_S.DECODING, ramp), _S.FINISHED, Guard(when=("length_reached",)),
                   FinishReason.LENGTH),
        Transition(_T.FINISH_LENGTH, (wind,), _S.FINISHED, Guard(when=("length_reached",), unless=(full,)),
                   FinishReason.LENGTH),
    ]
    stages = (_INTAKE_STAGE, Stage("mtp", Phase.MTP, (_T.MTP, _T.MTP_FAIL)),
              Stage("publish", Phase.PUBLISH, (_T.RAMP, _T.PUBLISH, _T.WIND)),
              Stage("end", Phase.PUBLISH, (_T.WOUND_DOWN, _T.FINISH_LENGTH)))
    classes = attrs.evolve(CLASSES, live=CLASSES.live | {ramp, wind})
    return LifecycleSpec(
        "delay_pattern", "Codebooks under a delay pattern: ramp-up, EOC wind-down (Higgs Audio v3)",
        tuple(transitions), stages, classes, HOST_TRIGGERS,
    )


def stop_head_lifecycle() -> LifecycleSpec:
    """Every step publishes a frame, CB0 being a stop class (VoxCPM2: the 2-way stop head,
    EOS id 1) and the MTP stage the frame's continuous payload (the local DiT's patch): the
    frame sampled with the stop is still published, and then ends the request (reason eos)."""
    transitions = [
        *_host_edges(),
        *_intake(_S.SAMPLED),
        Transition(_T.MTP, (_S.SAMPLED,), _S.FRAME_READY, Guard(unless=("mtp_fault",))),
        Transition(_T.MTP_FAIL, (_S.SAMPLED,), _S.ABORTED, Guard(when=("mtp_fault",)), FinishReason.ERROR),
        Transition(_T.PUBLISH, (_S.FRAME_READY,), _S.DECODING, ALWAYS, publishes=True),
        Transition(_T.LAST_FRAME, (_S.DECODING,), _S.FINISHED, Guard(when=("eos_frame",)), FinishReason.EOS),
        Transition(_T.FINISH_LENGTH, (_S.DECODING,), _S.FINISHED, Guard(when=("length_reached",), unless=("eos_frame",)),
                   FinishReason.LENGTH),
    ]
    stages = (_INTAKE_STAGE, Stage("mtp", Phase.MTP, (_T.MTP, _T.MTP_FAIL)), _PUBLISH_STAGES[0],
              Stage("end", Phase.PUBLISH, (_T.LAST_FRAME, _T.FINISH_LENGTH)))
    return LifecycleSpec(
        "stop_head", "Stop head and continuous payload: the stop frame is published, then ends (VoxCPM2)",
        tuple(transitions), stages, CLASSES, HOST_TRIGGERS,
    )


def speculative_lifecycle() -> LifecycleSpec:
    """Speculative decoding with a drafter (DeepSeek-V3 / MiMo style MTP module): a decode row
    holds the last accepted token and k drafts; one forward verifies them all, and the
    sample and publish stages run once per verify position. The target's token at each
    position is sampled exactly as plain decoding would (counter-based noise keyed by the
    frame index), so a draft is accepted iff it equals that token: the frames are the same
    as without speculation for any k and any draft quality.

    A position whose draft matches publishes and goes on verifying (`accept`); the first
    whose draft misses, or the last (no draft left), publishes the target's own token and
    settles (`bonus`); later positions are rejected (`reject`: nothing they computed is
    kept, num_computed stops at the last accepted token, which is the rollback). Then the
    drafter proposes the next step's k tokens from the accepted ones (`draft`, MTP phase)."""
    verifying, drafting, bad = _S.VERIFYING, _S.DRAFTING, "cb0_fault"
    transitions = [
        *_host_edges(),
        Transition(_T.PREFILL, _IN_PROMPT, _S.PREFILLING, Guard(unless=("prompt_done",))),
        Transition(_T.SAMPLE, _IN_PROMPT, _S.FRAME_READY, Guard(when=("prompt_done",), unless=(bad,))),
        Transition(_T.SAMPLE, (_S.DECODING, verifying), _S.FRAME_READY, Guard(unless=(bad,))),
        Transition(_T.FAIL, _IN_PROMPT, _S.ABORTED, Guard(when=("prompt_done", bad)), FinishReason.ERROR),
        Transition(_T.FAIL, (_S.DECODING, verifying), _S.ABORTED, Guard(when=(bad,)), FinishReason.ERROR),
        Transition(_T.REJECT, (drafting,), drafting, ALWAYS),
        Transition(_T.OVERRUN, (_S.FINISHED,), _S.FINISHED, ALWAYS),
        Transition(_T.OVERRUN, (_S.ABORTED,), _S.ABORTED, ALWAYS),
        Transition(_T.EOS, (_S.FRAME_READY,), _S.FINISHED, Guard(when=("eos_sampled",)), FinishReason.EOS),
        Transition(_T.ACCEPT, (_S.FRAME_READY,), verifying, Guard(when=("draft_accepted",)), publishes=True),
        Transition(_T.BONUS, (_S.FRAME_READY,), drafting, Guard(unless=("draft_accepted",)), publishes=True),
        Transition(_T.FINISH_LENGTH, (verifying, drafting), _S.FINISHED, Guard(when=("length_reached",)),
                   FinishReason.LENGTH),
        # The drafter's logits were not finite: loud, like any bad sample (reason error).
        Transition(_T.DRAFT, (verifying, drafting), _S.DECODING, Guard(unless=("mtp_fault",))),
        Transition(_T.MTP_FAIL, (verifying, drafting), _S.ABORTED, Guard(when=("mtp_fault",)), FinishReason.ERROR),
    ]
    stages = (Stage("intake", Phase.SAMPLE, (_T.PREFILL, _T.SAMPLE, _T.FAIL, _T.REJECT, _T.OVERRUN), total=True),
              _EOS_STAGE, Stage("verify", Phase.PUBLISH, (_T.ACCEPT, _T.BONUS)),
              Stage("length", Phase.PUBLISH, (_T.FINISH_LENGTH,)),
              Stage("draft", Phase.MTP, (_T.DRAFT, _T.MTP_FAIL)))
    classes = attrs.evolve(CLASSES, live=CLASSES.live | {verifying}, in_step=CLASSES.in_step | {drafting})
    return LifecycleSpec(
        "speculative", "Speculative decoding: draft, verify, accept or reject (DeepSeek-V3 / MiMo MTP drafter)",
        tuple(transitions), stages, classes, HOST_TRIGGERS,
        phase_order=(Phase.SAMPLE, Phase.PUBLISH, Phase.MTP), verify_loop=True,
    )


VARIANTS = {
    "mtp": mtp_lifecycle, "single_codebook": single_codebook_lifecycle, "mtp_stop": mtp_stop_lifecycle,
    "conditioned": conditioned_lifecycle, "mtp_stop_deferred": mtp_stop_deferred_lifecycle,
    "delay_pattern": delay_pattern_lifecycle, "stop_head": stop_head_lifecycle,
    "speculative": speculative_lifecycle,
}


# Each deferred variant and the current-step variant whose frames it publishes one step later.
CURRENT_STEP_TWIN = {"mtp_stop_deferred": "mtp_stop"}


def current_step_twin(spec: LifecycleSpec) -> LifecycleSpec:
    """The current-step variant a reference runs for `spec` (itself unless deferred)."""
    return VARIANTS[CURRENT_STEP_TWIN[spec.name]]() if spec.deferred else spec


def lifecycle_for(name: str) -> LifecycleSpec:
    try:
        return VARIANTS[name]()
    except KeyError:
        raise ValueError(f"unknown lifecycle variant {name!r}; known: {sorted(VARIANTS)}") from None
