"""`mtp-fsm demo --backend vllm`: the embedded demo's requests, sinks and summary, scheduled by vLLM."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from ..engine.plan import FrameBatch, NewRequest
from ..serving import ChunkingSink, JsonlSink
from ..cli import report_demo, speculation_line
from .llm import TalkerLLM


def run_vllm_demo(args: argparse.Namespace, texts: tuple[str, ...]) -> int:
    """vLLM's scheduler decides admission, chunking (`--prefill-chunk` is vLLM's
    long_prefill_token_threshold, `--token-budget` its max_num_batched_tokens) and
    preemption; frames reach the sinks per request when it ends (pulled from the worker)."""
    if args.preempt_after is not None:
        raise ValueError("--preempt-after is the built-in scheduler's policy; under --backend vllm, vLLM preempts")
    kernels = "torch" if args.kernels == "auto" else args.kernels
    # vLLM logs to stdout at INFO (and warns about the tokenizer the talker does not use): keep
    # the demo's output its summary.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    speculate = getattr(args, "speculate", 0)
    llm = TalkerLLM(args.model, seed=args.seed, max_num_seqs=args.max_slots, kernels=kernels,
                    max_num_batched_tokens=max(args.token_budget, args.max_slots),
                    long_prefill_token_threshold=max(args.prefill_chunk, 1 + speculate), speculate=speculate)
    chunk_sizes: list[int] = []
    chunker = ChunkingSink(lambda chunk: chunk.has_audio and chunk_sizes.append(len(chunk.frames)),
                           num_codebooks=llm.talker.model.spec.num_codebooks)
    jsonl = JsonlSink(os.path.join(args.out, "frames.jsonl"))
    print(f"mtp-fsm demo (vLLM {_vllm_version()}): {llm.talker.name}, {args.requests} requests, {args.max_slots} "
          f"seqs, budget {args.token_budget}, chunk {args.prefill_chunk}", file=sys.stderr)
    try:
        for i in range(args.requests):
            llm.submit(NewRequest(f"req-{i:03d}", llm.talker.text_inputs(texts[i % len(texts)]),
                                  max_frames=args.max_frames, seed=args.seed + i))
        step = 0
        while llm.has_unfinished:
            for generation in llm.step():
                frames = FrameBatch((generation.request_id,) * len(generation.frames),
                                    torch.tensor([f.index for f in generation.frames], dtype=torch.int64),
                                    generation.codes() if generation.frames else
                                    torch.zeros(0, llm.talker.model.spec.num_codebooks, dtype=torch.int64))
                for sink in (jsonl, chunker):
                    if len(frames):
                        sink.on_frames(step, frames)
                    sink.on_finished(step, generation.finished)
            step += 1
    finally:
        jsonl.close()
    metrics = llm.metrics()
    stats = llm.speculation() if speculate else None
    llm.close()
    report_demo(metrics, chunker, len(chunk_sizes), args.out,
                f"{llm.talker.name} under vLLM: {args.requests} requests, {args.max_slots} seqs")
    if stats is not None:  # the worker engine's counts (its steps are vLLM's)
        print(speculation_line(stats, metrics.total_frames, metrics.num_steps))
    return 0


def _vllm_version() -> str:
    import vllm

    return vllm.__version__
