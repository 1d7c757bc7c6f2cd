"""The `mtp-fsm` command line: demo (serve a batch of TTS requests), plus the bench and diagrams commands."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

DEMO_TEXTS = (
    "Hello there, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Please turn left at the next corner.",
    "It looks like rain this afternoon.",
    "Your order has shipped.",
    "Thank you for calling, please hold.",
    "The meeting starts at nine tomorrow.",
    "I would like a cup of tea.",
    "Trains to the airport leave every ten minutes.",
    "Good morning, everyone.",
    "Remember to back up your files.",
    "The museum is closed on Mondays.",
    "She sells sea shells by the sea shore.",
    "Welcome back, we missed you.",
    "Dinner will be ready in five minutes.",
    "Have a safe trip home.",
)


def positive(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .serving.model_loader import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="mtp-fsm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve a batch of TTS requests with the tiny random model")
    demo.add_argument("--requests", type=positive, default=16, help="number of requests (texts are cycled)")
    demo.add_argument("--max-slots", type=positive, default=8, help="slot table rows (concurrent requests)")
    demo.add_argument(
        "--prefill-chunk", type=positive, default=4,
        help="prompt tokens per prefill chunk (the tiny prompt is 8 positions: 4 shows chunked prefill)",
    )
    demo.add_argument("--token-budget", type=positive, default=256, help="tokens per engine step")
    demo.add_argument("--seed", type=int, default=0, help="model weights seed; request i samples with seed+i")
    demo.add_argument("--max-frames", type=positive, default=48, help="frame budget per request")
    demo.add_argument("--model", default=DEFAULT_MODEL, help="talker factory as 'package.module:factory'")
    demo.add_argument("--out", default="demo_out", help="output folder (states.png, frames.jsonl)")
    demo.add_argument("--preempt-after", type=positive, default=None, metavar="N",
                      help="preempt the newest running request when the queue head waited N steps for a slot")
    demo.add_argument("--kernels", default="auto", choices=("auto", "torch", "triton"))
    demo.add_argument("--threads", type=int, default=1,
                      help="torch intra-op threads (0: torch's default); the tiny model's ops are too small to "
                           "gain from more, and on a busy machine extra threads spin and slow every step")
    demo.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    for name, what in (("bench", "benchmarks (mtp_fsm.bench)"), ("diagrams", "lifecycle diagrams (mtp_fsm.lifecycle.diagrams)")):
        # add_help=False: --help belongs to the plugin, which parses its own arguments.
        p = sub.add_parser(name, help=f"{what}; arguments are passed through", add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "demo":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        from .errors import MtpFsmError
        from .serving.model_loader import ModelLoadError

        try:
            return run_demo(args)
        except (ModelLoadError, MtpFsmError) as exc:  # bad configuration: say what, no traceback
            print(f"mtp-fsm demo: error: {exc}", file=sys.stderr)
            return 2
    if args.command == "bench":
        from .bench import main as plugin_main
    else:
        from .lifecycle.diagrams import main as plugin_main
    return plugin_main([*extra, *args.args])


def run_demo(args: argparse.Namespace) -> int:
    from ._util.threads import torch_threads

    with torch_threads(args.threads):  # restored after, so in-process callers (tests) keep their setting
        return _demo(args)


def _demo(args: argparse.Namespace) -> int:
    from .engine import LockstepEngine, NewRequest
    from .serving import ChunkingSink, JsonlSink, SchedulingPolicy, ServingLoop
    from .serving.model_loader import load_talker
    from .serving.plots import plot_states

    os.makedirs(args.out, exist_ok=True)
    talker = load_talker(args.model, seed=args.seed)
    policy = SchedulingPolicy(args.token_budget, args.prefill_chunk, preempt_after_steps=args.preempt_after)
    engine = LockstepEngine(talker.model, args.max_slots, kernels=args.kernels, policy=policy)
    chunk_sizes: list[int] = []  # a stand-in vocoder: the demo only counts what it would decode
    chunker = ChunkingSink(lambda chunk: chunk_sizes.append(len(chunk.frames)), num_codebooks=engine.spec.num_codebooks)
    jsonl = JsonlSink(os.path.join(args.out, "frames.jsonl"))
    loop = ServingLoop(engine, sinks=(jsonl, chunker))
    print(f"mtp-fsm demo: {talker.name}, {args.requests} requests, {args.max_slots} slots, "
          f"budget {args.token_budget}, chunk {args.prefill_chunk}", file=sys.stderr)
    try:
        for i in range(args.requests):
            text = DEMO_TEXTS[i % len(DEMO_TEXTS)]
            loop.submit(NewRequest(f"req-{i:03d}", talker.text_inputs(text),
                                   max_frames=args.max_frames, seed=args.seed + i))
        progress = _Progress(args.requests, loop, enabled=not args.no_progress)
        loop.run_until_idle(on_step=progress.update)
        progress.close()
    finally:
        jsonl.close()
    summary = loop.metrics.summary()
    plot_states(loop.metrics, os.path.join(args.out, "states.png"),
                title=f"{talker.name}: {args.requests} requests, {args.max_slots} slots")
    print(summary.table())
    print(f"{'audio chunks':<23}  {len(chunk_sizes)} (first chunks of {chunker.first_chunk} frames, then {chunker.chunk})")
    print(f"wrote {os.path.join(args.out, 'states.png')} and {os.path.join(args.out, 'frames.jsonl')}")
    return 0


class _Progress:
    """A one-line progress bar on stderr, redrawn in place with a carriage return."""

    WIDTH = 30

    def __init__(self, total: int, loop, enabled: bool = True) -> None:
        self.total, self.loop, self.enabled = max(total, 1), loop, enabled

    def update(self, output) -> None:
        if not self.enabled:
            return
        done = self.loop.metrics.num_finished
        filled = int(self.WIDTH * done / self.total)
        frames = sum(r.num_frames for r in self.loop.metrics.requests.values())
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        sys.stderr.write(f"\r[{bar}] {done}/{self.total} done  step {output.step + 1}  frames {frames}  ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
