"""run_mrv2_on_gpu: a real `vllm.LLM` on Model Runner V2 with FsmModelState, frames compared with the embedded engine."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from ...engine import LockstepEngine, NewRequest
from ..model_dir import TalkerDirConfig, stop_token_id
from ..request_codec import EXTRA_ARGS_KEY, encode_request
from .standin import register, write_mrv2_model_dir

VLLM_VERSION = "0.32.0"
TEXTS = ("Hello there.", "A longer sentence to speak, with a comma.", "Short.", "Numbers: one two three four five.")
EXTENSION_CLS = f"{__name__}.FsmMRV2WorkerExt"


class FsmMRV2WorkerExt:
    """Worker extension (`worker_extension_cls`, add-only): the pull channel under MRV2."""

    def mtp_fsm_mrv2_take_frames(self):
        return self.model_runner.model_state.take_frames()

    def mtp_fsm_mrv2_info(self) -> dict[str, str]:
        runner, state = self.model_runner, getattr(self.model_runner, "model_state", None)
        return {"runner": f"{type(runner).__module__}.{type(runner).__qualname__}",
                "model_state": type(state).__qualname__ if state is not None else "none"}


def run_mrv2_on_gpu(talker: str = "qwen3_tts", *, num_requests: int = 6, max_frames: int = 24, max_num_seqs: int = 4,
                    max_num_batched_tokens: int = 16, seed: int = 0) -> dict[str, Any]:
    """On a CUDA machine with vllm==0.32.0: serve `num_requests` through vLLM (MRV2, in-process,
    eager, chunked prefill by the small token budget) and compare each request's frames with
    LockstepEngine.generate on the same device. Returns {"ok": bool, ...}; without CUDA,
    {"ok": False, "skipped": why} (nothing is started)."""
    if not torch.cuda.is_available():
        return {"ok": False, "skipped": "needs a GPU: vLLM's Model Runner V2 needs CUDA and Triton's GPU backend"}
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        return {"ok": False, "skipped": f"needs vllm=={VLLM_VERSION} (the ModelState hooks are version-specific), "
                                        f"found {vllm.__version__}"}
    # In-process engine core and worker: the in-process registration below is seen by the loader.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    config = TalkerDirConfig(talker, seed=seed, kernels="torch")
    loaded = config.load_talker()  # the frontend's copy: prompt lengths only
    spec = loaded.model.spec
    stop = stop_token_id(spec)
    requests = [NewRequest(f"gpu-{i}", loaded.text_inputs(TEXTS[i % len(TEXTS)]), max_frames=max_frames + 3 * (i % 3),
                           seed=1000 + i) for i in range(num_requests)]
    prompt_lens = [int(loaded.model.prepare(r.inputs).prompt_embeds.shape[0]) for r in requests]
    from vllm import LLM, SamplingParams

    register(in_process=True)
    with tempfile.TemporaryDirectory(prefix="mtp_fsm_mrv2_") as directory:
        write_mrv2_model_dir(directory, config, loaded.model)
        llm = LLM(model=directory, skip_tokenizer_init=True, enable_prefix_caching=False, enforce_eager=True,
                  load_format="dummy", dtype=str(spec.dtype).removeprefix("torch."), max_num_seqs=max_num_seqs,
                  max_model_len=min(spec.max_context, 4096), max_num_batched_tokens=max_num_batched_tokens,
                  worker_extension_cls=EXTENSION_CLS, seed=seed)
        info = llm.collective_rpc("mtp_fsm_mrv2_info")[0]
        params = [SamplingParams(max_tokens=r.max_frames, stop_token_ids=[stop], temperature=1.0, detokenize=False,
                                 extra_args={EXTRA_ARGS_KEY: encode_request(r)}) for r in requests]
        outputs = llm.generate([{"prompt_token_ids": [0] * p} for p in prompt_lens], params, use_tqdm=False)
        taken = [t for worker in llm.collective_rpc("mtp_fsm_mrv2_take_frames") for t in worker]
    got: dict[str, list[list[int]]] = {r.request_id: [] for r in requests}
    for t in taken:
        if t.request_id in got:
            got[t.request_id] += t.codes.tolist()
    reference = LockstepEngine(config.load_talker().model, max_num_seqs, device="cuda", kernels="torch").generate(requests)
    per_request = {}
    for request, output in zip(requests, outputs):
        rid = request.request_id
        want = [f.codes.tolist() for f in reference[rid].frames]
        tokens = list(output.outputs[0].token_ids)
        per_request[rid] = {"frames": len(got[rid]), "reference_frames": len(want), "equal": got[rid] == want,
                            "cb0_matches_tokens": [f[0] for f in got[rid]] == [t for t in tokens if t != stop]}
    ok = info["model_state"] == "FsmModelState" and all(v["equal"] and v["cb0_matches_tokens"]
                                                         for v in per_request.values())
    return {"ok": ok, "runner": info, "requests": per_request}


if __name__ == "__main__":
    import json
    import sys

    result = run_mrv2_on_gpu()
    print(json.dumps(result, indent=2, default=str))
    sys.exit(0 if result["ok"] or "skipped" in result else 1)
