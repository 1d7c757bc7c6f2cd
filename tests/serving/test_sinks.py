"""InMemorySink copies, CallbackSink forwarding, JsonlSink output."""

import json

import torch

from mtp_fsm.engine import FinishedRequest, FrameBatch
from mtp_fsm.lifecycle import FinishReason
from mtp_fsm.serving import CallbackSink, InMemorySink, JsonlSink, Sink


def _batch():
    return FrameBatch(("a", "b"), torch.tensor([0, 3]), torch.tensor([[1, 2], [3, 4]]))


def test_in_memory_sink_keeps_its_own_copies():
    sink = InMemorySink()
    b = _batch()
    sink.on_frames(0, b)
    b.codes.fill_(0)
    b.frame_index.fill_(9)
    sink.on_finished(1, FinishedRequest("a", FinishReason.EOS, 1))
    assert sink.frames == {"a": [(0, [1, 2])], "b": [(3, [3, 4])]}
    assert sink.codes("a") == [[1, 2]] and sink.codes("zzz") == []
    assert sink.reasons() == {"a": FinishReason.EOS}
    assert isinstance(sink, Sink)


def test_callback_sink_forwards_and_tolerates_missing_callbacks():
    got = []
    sink = CallbackSink(on_frames=lambda step, frames: got.append((step, frames.request_ids)))
    sink.on_frames(4, _batch())
    sink.on_finished(4, FinishedRequest("a", FinishReason.EOS, 1))
    assert got == [(4, ("a", "b"))]


def test_jsonl_sink_writes_parseable_flushed_lines(tmp_path):
    path = tmp_path / "frames.jsonl"
    sink = JsonlSink(path)
    sink.on_frames(0, _batch())
    # flushed: readable before close
    assert len(path.read_text().splitlines()) == 2
    sink.on_finished(1, FinishedRequest("a", FinishReason.ERROR, 1, "boom"))
    sink.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"type": "frame", "step": 0, "request_id": "a", "frame_index": 0, "codes": [1, 2]}
    assert lines[1]["frame_index"] == 3 and lines[1]["codes"] == [3, 4]
    assert lines[2] == {"type": "finished", "step": 1, "request_id": "a", "reason": "error", "num_frames": 1,
                        "detail": "boom"}
