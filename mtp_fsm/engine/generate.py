"""`LockstepEngine.generate`: run a batch of requests to their end with the built-in policy,
validated all-or-nothing first, every request given exactly one end."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from ..errors import AdmissionError, DuplicateRequestError
from ..lifecycle import FinishReason
from .outputs import FinishedRequest, Generation, StepOutput
from .plan import NewRequest

if TYPE_CHECKING:
    from .engine import LockstepEngine


def generate(engine: "LockstepEngine", requests: Iterable[NewRequest],
             on_step: Callable[["LockstepEngine", StepOutput], None] | None = None) -> dict[str, Generation]:
    """Frames and finish per request (see `LockstepEngine.generate`)."""
    requests = list(requests)
    check_batch(engine, requests)
    results: dict[str, Generation] = {}
    for request in requests:
        engine.add_request(request)
        results[request.request_id] = Generation(request.request_id)
    while (output := engine.step()) is not None:
        for frame in output.frames:
            if frame.request_id in results:
                results[frame.request_id].frames.append(frame)
        for finished in output.finished:
            if finished.request_id in results:
                results[finished.request_id].finished = finished
        if on_step is not None:
            on_step(engine, output)
    held = engine.requests()
    for rid, generation in results.items():
        if generation.finished is None and rid not in held:  # dropped from the queue by an abort
            generation.finished = FinishedRequest(rid, FinishReason.ABORT, len(generation.frames),
                                                  "aborted while queued")
    return results


def check_batch(engine: "LockstepEngine", requests: list[NewRequest]) -> None:
    """Every request admissible and its id new (in the engine and in the batch), or the error
    naming the first that is not; nothing is queued either way."""
    seen: set[str] = set()
    held = engine.requests()
    for request in requests:
        if not isinstance(request, NewRequest):
            raise AdmissionError(repr(request)[:60], f"not a NewRequest ({type(request).__name__}); nothing queued")
        rid = request.request_id
        if rid in seen or rid in held:
            raise DuplicateRequestError(rid, "the id is already in the engine or twice in this batch; nothing "
                                        "queued", held.get(rid, "in this batch"))
        seen.add(rid)
        try:
            engine.ledger.admission.admissible(request)
        except AdmissionError as exc:
            raise AdmissionError(rid, f"{exc.reason}; nothing queued") from exc
