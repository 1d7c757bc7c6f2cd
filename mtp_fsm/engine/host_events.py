"""A step's host events (release, abort, preempt, resume, admit): validated all-or-nothing through
the lifecycle's `transitions` machine, committed on the request table, staged for the device;
and a failed step's rows, ended like a client abort, with its output. A steady decode step has
none of these."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import attrs
import torch

from ..errors import DuplicateRequestError, LifecycleError, PlanError, SlotTableFullError
from ..kernels.contract import ReplayFrames, StagedAdmits, StagedEvents
from ..lifecycle import FinishReason, Trigger
from ..model_api import ModelSpec
from ..slots import SlotTable
from .admission import resolved
from .outputs import FinishedRequest, FrameBatch, RowOutput, StepOutput
from .plan import StepPlan
from .records import RequestRecord

if TYPE_CHECKING:
    from .ledger import HostStep, Ledger


@attrs.frozen
class CommittedEvents:
    """What a plan's host events did: the device's staged inputs and the host's records."""

    events: StagedEvents | None = None
    admits: StagedAdmits | None = None
    replay: ReplayFrames | None = None
    ended: tuple[FinishedRequest, ...] = ()  # aborts applied at this boundary
    admitted: tuple[RequestRecord, ...] = ()  # new and resumed requests given a slot


NO_EVENTS = CommittedEvents()


class HostEvents:
    """The ledger's host events: it reads and writes the ledger's records, queue, allocator
    and request table (the ledger owns them; this owns the rules for changing them)."""

    def __init__(self, ledger: "Ledger") -> None:
        self.ledger = ledger

    def _check_trigger(self, record: RequestRecord, trigger: Trigger) -> None:
        if not self.ledger.oracle.may(record, trigger):
            raise LifecycleError(record.request_id, record.state, trigger)

    def validate(self, plan: StepPlan) -> dict[str, object]:
        """Every host trigger of the plan checked, nothing changed; returns the new requests'
        prepared prompts by id (raises naming the first bad request)."""
        ledger = self.ledger
        touched: dict[str, str] = {}

        def once(request_id: str, what: str) -> None:
            if request_id in touched:
                raise PlanError(request_id, None, f"named twice in one plan ({touched[request_id]} and {what})")
            touched[request_id] = what

        freed = 0
        for rid in plan.releases:
            once(rid, "release")
            record = ledger.record(rid, "release")
            self._check_trigger(record, Trigger.RELEASE)
            if record.slot is None:
                raise PlanError(rid, record.state.label, "holds no slot to release (a preempted request is resumed "
                                "or aborted, not released)")
            freed += 1
        for rid in plan.aborts:
            once(rid, "abort")
            record = ledger.record(rid, "abort")
            self._check_trigger(record, Trigger.ABORT)
            freed += record.slot is not None
        for rid in plan.preempts:
            once(rid, "preempt")
            self._check_trigger(ledger.record(rid, "preempt"), Trigger.PREEMPT)
            freed += 1
        for rid in plan.resumes:
            once(rid, "resume")
            record = ledger.record(rid, "resume")
            self._check_trigger(record, Trigger.RESUME)
            if not ledger.ready_to_resume(record):
                raise PlanError(rid, record.state.label, f"cannot resume before conditioning row {record.num_frames - 1} "
                                "arrives (its replayed frames read it; engine.feed)")
        prepared = {}
        for req in plan.new_requests:
            rid = req.request_id
            queued = ledger.queued.get(rid)
            if queued is not None and queued.request is req:  # enqueued earlier: validated then
                prepared[rid] = queued.prepared
                continue
            if rid in prepared:
                raise DuplicateRequestError(rid, "named twice among this plan's new requests", "new")
            if rid in ledger.records or rid in ledger.queued:
                known = ledger.records.get(rid) or ledger.queued.get(rid)
                raise DuplicateRequestError(rid, "a request with this id is already in the engine", known.state.label)
            prepared[rid] = ledger.admission.admissible(req)
        wanted = len(plan.resumes) + len(plan.new_requests)
        available = ledger.allocator.num_free + freed if wanted else 0
        if wanted > available:
            late = [*plan.resumes, *(r.request_id for r in plan.new_requests)][available]
            raise SlotTableFullError(
                late, f"no free slot: {wanted} admissions for {available} free of {ledger.table.max_slots} slots; "
                "queue it until a request finishes",
            )
        return prepared

    def commit(self, plan: StepPlan, prepared: dict[str, object]) -> CommittedEvents:
        """Apply a validated plan's events in order (releases, aborts, preempts, resumes, new
        requests): each fires through the `transitions` machine on its record, whose state is
        the table row's; the device applies the same chains to its rows (StagedEvents)."""
        ledger = self.ledger
        ledger.generation += 1
        ev_slots, ev_triggers, ev_reasons, ended = [], [], [], []

        def event(slot: int, triggers: Iterable[Trigger], reason: FinishReason = FinishReason.NONE) -> None:
            trig = [int(t) for t in triggers]
            ev_slots.append(slot)
            ev_triggers.append(trig + [-1] * (2 - len(trig)))
            ev_reasons.append(int(reason))

        for rid in plan.releases:
            record = ledger.records.pop(rid)
            event(record.slot, [Trigger.RELEASE])
            ledger.oracle.fire(record, Trigger.RELEASE)
            self._vacate(record)
        for rid in plan.aborts:
            record = ledger.records.pop(rid)
            if record.slot is not None:
                event(record.slot, [Trigger.ABORT, Trigger.RELEASE], FinishReason.ABORT)
                ledger.oracle.fire_all(record, (Trigger.ABORT, Trigger.RELEASE))
                self._vacate(record)
            else:
                ledger.oracle.fire(record, Trigger.ABORT)
            ended.append(FinishedRequest(rid, FinishReason.ABORT, record.num_frames))
        for rid in plan.preempts:
            record = ledger.records[rid]
            event(record.slot, [Trigger.PREEMPT, Trigger.RELEASE])
            ledger.oracle.fire(record, Trigger.PREEMPT)
            # Device-side clone (no sync): the frames resume will replay into the prompt.
            record.replay_codes = ledger.table.frame_log[record.slot, : record.num_frames].clone()
            self._vacate(record)
        admitted: list[RequestRecord] = []
        for rid in plan.resumes:
            record = ledger.records[rid]
            ledger.oracle.fire(record, Trigger.RESUME)
            record.prompt_len, record.num_computed = ledger.resume_prompt_len(record), 0
            admitted.append(record)
        for req in plan.new_requests:
            ledger.admission.forget(req)
            record = ledger.queued.pop(req.request_id, None) or RequestRecord(req, ledger.rows, prepared[req.request_id])
            ledger.oracle.fire(record, Trigger.ADMIT)
            ledger.records[req.request_id] = record
            admitted.append(record)
        for record in admitted:
            record.attach(ledger.allocator.allocate())
            record.serial, ledger.next_serial = ledger.next_serial, ledger.next_serial + 1
        device = ledger.table.device
        events = stage_events(ev_slots, ev_triggers, ev_reasons, device) if ev_slots else None
        admits, replay = stage_admits(ledger.table, ledger.spec, admitted, int(Trigger.ADMIT))
        return CommittedEvents(events, admits, replay, tuple(ended), tuple(admitted))

    def _vacate(self, record: RequestRecord) -> None:
        """The record leaves its slot: its counters park in it (a preempted one keeps state
        `preempted`), and the row is vacant, as the device leaves it after the chain's release."""
        self.ledger.allocator.release(record.slot)
        record.detach(self.ledger.vacant_state)
        record.serial = 0

    def fail_step(self, host: "HostStep", step: int, exc: BaseException, kernels, lc) -> StepOutput:
        """Step `step`, whose model raised `exc`: `fail_rows` on the host, then the device rows
        rolled back to their state at the step boundary (the request table's) and aborted and
        released through the transition table, like a client abort. Returns the step's output:
        no frame, every row invalid, the boundary's aborts and then the requests it ended."""
        slots, before, ended = self.fail_rows(host, f"model raised during step {step}: {exc!r}")
        if slots:
            table = self.ledger.table
            index = torch.tensor(slots, dtype=torch.int64, device=table.device)
            table.state[index] = torch.tensor(before, dtype=table.state.dtype, device=table.device)
            kernels.apply_host_events(table, lc, StagedEvents(
                index,
                torch.tensor([[int(Trigger.ABORT), int(Trigger.RELEASE)]] * len(slots), dtype=torch.int64,
                             device=table.device),
                torch.full((len(slots),), int(FinishReason.ERROR), dtype=torch.int32, device=table.device),
            ))
        rows, width = len(host.row_ids), self.ledger.spec.frame_width
        return StepOutput(
            step,
            FrameBatch.empty(width),
            tuple(host.ended) + tuple(ended),
            RowOutput(
                host.row_ids, host.query_start_loc.clone(), torch.zeros(rows, dtype=torch.bool),
                torch.zeros(rows, width, dtype=torch.int64),
            ),
            host.batch.num_tokens,
            host.preempted,
        )

    def fail_rows(self, host: "HostStep", detail: str) -> tuple[list[int], list[int], list[FinishedRequest]]:
        """A step whose model raised: its scheduled and newly admitted live requests end
        with reason error and free their slots at once, like a client abort (the host ended
        them; a request the device ends keeps its slot until released).

        Returns their slots, their states before the step (the device rolls back to them,
        then aborts and releases through the table) and their finish records. Requests that
        were already terminal (overrun rows) are left as they were.
        """
        ledger = self.ledger
        slots, before, ended = [], [], []
        ledger.generation += 1
        affected = {id(r): r for r in [*host.row_records, *host.admitted] if r is not None}
        for record in affected.values():
            if record.slot is None or record.state in ledger.terminal_states:
                continue
            before.append(int(record.state))
            slots.append(record.slot)
            ledger.oracle.fire_all(record, (Trigger.ABORT, Trigger.RELEASE))
            self._vacate(record)
            del ledger.records[record.request_id]
            ended.append(FinishedRequest(record.request_id, FinishReason.ERROR, record.num_frames, detail))
        return slots, before, ended


def stage_events(slots: list[int], triggers: list[list[int]], reasons: list[int],
                 device: torch.device) -> StagedEvents:
    """Host events (up to two triggers per slot, -1 = none; the finish reason to record) for the device."""
    return StagedEvents(upload(torch.tensor(slots, dtype=torch.int64), device),
                        upload(torch.tensor(triggers, dtype=torch.int64), device),
                        upload(torch.tensor(reasons, dtype=torch.int32), device))


def _home(tensors, device: torch.device) -> torch.device:
    """Where to assemble tensors bound for `device`: there when any of them already is (a
    model that prepares on the device, frames captured from the slot table), so nothing goes
    device -> host -> device; else on the host, for one upload."""
    return device if any(t is not None and t.device == device for t in tensors) else torch.device("cpu")


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor to a CUDA device through pinned memory (an async copy: no host sync)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def stage_admits(table: SlotTable, spec: ModelSpec, admitted: list[RequestRecord], trigger: int):
    """Values every admitted row is initialised with, and the frames resumed rows replay."""
    if not admitted:
        return None, None
    device = table.device
    longest = max(r.base_prompt_len for r in admitted)
    home = _home([r.prepared.prompt_embeds for r in admitted], device)
    prompts = torch.zeros(len(admitted), longest, spec.hidden_size, dtype=spec.dtype, device=home)
    for i, r in enumerate(admitted):
        prompts[i, : r.prepared.prompt_embeds.shape[0]] = r.prepared.prompt_embeds.to(home)
    req = [r.request for r in admitted]
    cb0, mtp = zip(*(resolved(spec, r) for r in admitted))
    values = {
        "serial": [r.serial for r in admitted], "prompt_len": [r.prompt_len for r in admitted],
        "num_frames": [r.num_frames for r in admitted], "max_frames": [q.max_frames for q in req],
        "seed": [q.seed for q in req],
        "cb0_temperature": [p.temperature for p in cb0], "cb0_top_k": [p.top_k for p in cb0],
        "cb0_top_p": [p.top_p for p in cb0], "cb0_penalty": [p.repetition_penalty for p in cb0],
        "min_frames": [r.min_frames for r in admitted],
        "mtp_temperature": [p.temperature for p in mtp], "mtp_top_k": [p.top_k for p in mtp],
        "mtp_top_p": [p.top_p for p in mtp],
    }
    columns = table.columns()
    staged = {k: upload(torch.tensor(v, dtype=columns[k].dtype), device) for k, v in values.items()}
    staged["prompt_embeds"] = upload(prompts, device)
    for name in table.extra:
        given = [r.column_value(name) for r in admitted]
        if all(g is None for g in given):
            continue
        tail = tuple(max(dims) for dims in zip(*(g.shape for g in given if g is not None)))
        # Padding beyond a shorter value (and rows that give none) holds the declared fill.
        home = _home(given, device)
        stacked = torch.full((len(admitted), *tail), table.extra_fill[name], dtype=columns[name].dtype, device=home)
        for i, g in enumerate(given):
            if g is not None:
                stacked[i][tuple(slice(0, n) for n in g.shape)] = g.to(home)
        staged[name] = upload(stacked, device)
    slots = upload(torch.tensor([r.slot for r in admitted], dtype=torch.int64), device)
    replays = [(r, r.replay_codes) for r in admitted if r.replay_codes is not None and len(r.replay_codes)]
    replay = None
    if replays:
        home = _home([c for _, c in replays], device)  # the codes were captured from the slot table
        log = torch.zeros(len(admitted), max(len(c) for _, c in replays), spec.frame_width, dtype=torch.int64,
                          device=home)
        for i, r in enumerate(admitted):
            if r.replay_codes is not None:
                log[i, : len(r.replay_codes)] = r.replay_codes.to(home)
        staged["frame_log"] = upload(log, device)
        # The last published frame (what a delay pattern's wind-down and a payload's `previous`
        # continue from): row i's log at its frame count - 1 (zeros for a row with none).
        frames = upload(torch.tensor([0 if r.replay_codes is None else len(r.replay_codes) for r in admitted]), home)
        last = log[torch.arange(len(admitted), device=home), (frames - 1).clamp(min=0)]
        staged["frame_codes"] = upload(torch.where((frames > 0)[:, None], last, 0), device)
        # The repetition penalty's CB0 counts, rebuilt exactly from the replayed frames (a
        # scatter-add: bincount would read its output size back from the device).
        counts = torch.zeros(len(admitted), table.cb0_counts.shape[1], dtype=table.cb0_counts.dtype, device=home)
        for i, r in enumerate(admitted):
            if r.replay_codes is not None and len(r.replay_codes):
                cb0 = r.replay_codes[:, 0].to(home).clamp(0, counts.shape[1] - 1)
                counts[i].scatter_add_(0, cb0, torch.ones_like(cb0, dtype=counts.dtype))
        staged["cb0_counts"] = upload(counts, device)
        replay = ReplayFrames(
            slots=upload(torch.cat([torch.full((len(c),), r.slot, dtype=torch.int64) for r, c in replays]), device),
            frame_index=upload(torch.cat([torch.arange(len(c)) for _, c in replays]), device),
            positions=upload(torch.cat([torch.arange(len(c)) + r.base_prompt_len for r, c in replays]), device),
            codes=upload(torch.cat([c.to(home) for _, c in replays]), device),
        )
        for r, _ in replays:
            r.replay_codes = None
    return StagedAdmits(slots, staged, trigger), replay
