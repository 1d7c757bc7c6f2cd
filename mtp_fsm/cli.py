"""The `mtp-fsm` command line: demo (serve a batch of TTS requests), serve (the online speech API), bench, diagrams."""

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


INT64_MAX = 2**63 - 1


class UsageError(Exception):
    """A user error found after parsing (e.g. an unusable output path): one line on stderr, exit 2."""


def _integer(text: str, lo: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not lo <= value <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive(text: str) -> int:
    """argparse type: an int >= 1."""
    return _integer(text, 1, "an integer >= 1")


def non_negative(text: str) -> int:
    """argparse type: an int >= 0."""
    return _integer(text, 0, "an integer >= 0")


def seed64(text: str) -> int:
    """argparse type: a 64-bit signed int."""
    return _integer(text, -(2**63), "a 64-bit integer")


def output_dir(path: str, *, create: bool = True) -> str:
    """Check that `path` is (or can become) a writable folder, creating it (and parents)
    unless create=False; UsageError saying why not."""
    if not path:
        raise UsageError("the output folder is an empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"output folder {path!r} exists and is not a folder")
    if create:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create output folder {path!r}: {_os_message(exc)}") from None
        existing = path
    else:  # the nearest existing ancestor must be a writable folder
        existing = os.path.abspath(path)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise UsageError(f"cannot create output folder {path!r}: {existing!r} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"output folder {path!r} is not writable" + ("" if existing == path else f" ({existing!r})"))
    return path


def _os_message(exc: OSError) -> str:
    if exc.strerror and exc.filename is not None:
        return f"{exc.strerror}: {exc.filename!r}"
    return exc.strerror or str(exc)


def build_parser() -> argparse.ArgumentParser:
    from .serving.model_loader import DEFAULT_MODEL

    from .api.server import add_serve_parser, package_version

    parser = argparse.ArgumentParser(prog="mtp-fsm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mtp-fsm {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub, positive, seed64)  # the online speech API (mtp_fsm/api/server.py)
    demo = sub.add_parser("demo", help="serve a batch of TTS requests with the tiny random model")
    demo.add_argument("--requests", type=positive, default=16, help="number of requests (texts are cycled)")
    demo.add_argument("--max-slots", type=positive, default=8, help="slot table rows (concurrent requests)")
    demo.add_argument(
        "--prefill-chunk", type=positive, default=4,
        help="prompt tokens per prefill chunk (the tiny prompt is 8 positions: 4 shows chunked prefill)",
    )
    demo.add_argument("--token-budget", type=positive, default=256, help="tokens per engine step")
    demo.add_argument("--seed", type=seed64, default=0, help="model weights seed; request i samples with seed+i")
    demo.add_argument("--max-frames", type=positive, default=48, help="frame budget per request")
    demo.add_argument("--model", default=DEFAULT_MODEL,
                      help="talker: qwen3_tts, qwen3_omni, moss_tts_local, chatterbox, higgs_audio_v3, voxcpm2, mtp_lm, or a factory import string "
                           "'package.module:factory'")
    demo.add_argument("--out", default="demo_out", help="output folder (states.png, frames.jsonl)")
    demo.add_argument("--preempt-after", type=positive, default=None, metavar="N",
                      help="preempt the newest running request when the queue head waited N steps for a slot")
    demo.add_argument("--kernels", default="auto", choices=("auto", "torch", "compiled", "triton"))
    demo.add_argument("--threads", type=non_negative, default=1,
                      help="torch intra-op threads (0: torch's default); the tiny model's ops are too small to "
                           "gain from more, and on a busy machine extra threads spin and slow every step")
    demo.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    demo.add_argument("--speculate", type=non_negative, default=0, metavar="K",
                      help="speculative decoding with the model's drafter, K drafts verified per step (a model "
                           "with a drafter: mtp_lm); the frames are those of K=0, in fewer steps")
    demo.add_argument("--backend", default="embedded", choices=("embedded", "vllm"),
                      help="embedded: the built-in scheduler; vllm: vLLM's engine core and scheduler drive the engine "
                           "(mtp_fsm.vllm.TalkerLLM)")
    demo.add_argument("--audio", action="store_true",
                      help="decode each request's codes with the talker's codec decoder (beside the step loop) and "
                           "write OUT/audio/<request>.wav, 16-bit PCM; logs first-audio latency and real-time factor")
    for name, what in (("bench", "benchmarks (mtp_fsm.bench)"), ("diagrams", "lifecycle diagrams (mtp_fsm.lifecycle.diagrams)")):
        # add_help=False: --help belongs to the plugin, which parses its own arguments.
        p = sub.add_parser(name, help=f"{what}; arguments are passed through", add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _user_error(command: str, message: object) -> int:
    """argparse-style: one line on stderr, exit status 2."""
    print(f"mtp-fsm {command}: error: {message}", file=sys.stderr)
    return 2


def _check_bench_args(argv: list[str]) -> None:
    """What the bench would only find out after minutes of timing: a bad --threads or --out-dir."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads")
    pre.add_argument("--out-dir")
    known, _ = pre.parse_known_args(argv)
    if known.threads is not None:
        try:
            non_negative(known.threads)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"argument --threads: {exc}") from None
    if known.out_dir is not None:
        output_dir(known.out_dir, create=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    from ._util.marked_block import MarkedBlockError
    from .errors import MtpFsmError
    from .serving.model_loader import ModelLoadError

    if args.command == "demo":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.seed + args.requests - 1 > INT64_MAX:  # request i samples with seed + i
            return _user_error("demo", f"argument --seed: {args.seed} + {args.requests} requests overflows a 64-bit seed")
        try:
            return run_demo(args)
        except (ModelLoadError, MtpFsmError, UsageError) as exc:  # bad configuration: say what, no traceback
            return _user_error("demo", exc)
        except OSError as exc:  # the output folder went away or filled up mid-run
            return _user_error("demo", _os_message(exc))
    if args.command == "serve":
        from .api.server import run_serve

        try:
            return run_serve(args, extra)
        except (ModelLoadError, MtpFsmError, UsageError, ValueError) as exc:  # bad configuration: say what
            return _user_error("serve", exc)
    plugin_args = [*extra, *args.args]
    try:
        if args.command == "bench":
            _check_bench_args(plugin_args)
            from .bench import main as plugin_main
        else:
            from .lifecycle.diagrams import main as plugin_main
        return plugin_main(plugin_args)
    except (UsageError, MarkedBlockError, ModelLoadError) as exc:
        return _user_error(args.command, exc)
    except OSError as exc:  # e.g. an output path that cannot be written
        return _user_error(args.command, _os_message(exc))


def run_demo(args: argparse.Namespace) -> int:
    from ._util.threads import torch_threads

    with torch_threads(args.threads):  # restored after, so in-process callers (tests) keep their setting
        return _demo(args)


def _demo(args: argparse.Namespace) -> int:
    from .engine import LockstepEngine, NewRequest
    from .errors import ModelBindingError
    from .serving import ChunkingSink, JsonlSink, SchedulingPolicy, ServingLoop
    from .serving.model_loader import ModelLoadError, load_talker
    output_dir(args.out)  # before loading anything: a bad path fails at once
    if args.backend == "vllm":
        from .vllm.demo import run_vllm_demo

        if args.audio:
            raise UsageError("--audio runs on the embedded backend only")
        try:
            return run_vllm_demo(args, DEMO_TEXTS)
        except ValueError as exc:  # settings vLLM or the talker refuse
            raise UsageError(str(exc)) from exc
    try:
        talker = load_talker(args.model, seed=args.seed)
    except ModelLoadError:
        raise
    except Exception as exc:  # the factory itself raised: most likely not a talker factory (or wrong seed)
        raise UsageError(f"model {args.model!r}: its factory raised {type(exc).__name__}: {exc}") from exc
    policy = SchedulingPolicy(args.token_budget, args.prefill_chunk, preempt_after_steps=args.preempt_after)
    try:
        engine = LockstepEngine(talker.model, args.max_slots, kernels=args.kernels, policy=policy,
                                speculate=args.speculate)
    except ModelBindingError as exc:  # e.g. --speculate for a model without a drafter
        raise UsageError(str(exc)) from exc
    chunk_sizes: list[int] = []  # without --audio, a stand-in vocoder: the demo only counts what it would decode

    def count(chunk) -> None:
        if chunk.has_audio:  # an empty final chunk marks the end of a stream: no audio
            chunk_sizes.append(len(chunk.frames))

    audio = wavs = None
    if args.audio:
        audio, wavs = _audio_stage(args, engine)
        audio.add_observer(count)
        chunker = audio.chunker
    else:
        chunker = ChunkingSink(count, num_codebooks=engine.spec.frame_width)
    jsonl = JsonlSink(os.path.join(args.out, "frames.jsonl"))
    loop = ServingLoop(engine, sinks=(jsonl, chunker if audio is None else audio))
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
        if audio is not None:
            audio.close()  # the decoder's queue drained: every WAV that ends is written
            wavs.close()
    report_demo(loop.metrics, chunker, len(chunk_sizes), args.out,
                f"{talker.name}: {args.requests} requests, {args.max_slots} slots")
    if audio is not None and _report_audio(audio, wavs, loop.metrics, args.out):
        return 1
    if engine.speculation is not None:
        print(speculation_line(engine.speculation, loop.metrics.total_frames, engine.step_count))
    return 0


def _audio_stage(args: argparse.Namespace, engine):
    """The talker's decoder (tiny, seeded like the talker) streaming into one WAV per request."""
    import logging

    from .serving.audio_stream import AudioStream
    from .serving.codec import load_decoder
    from .serving.wav import WavWriter

    ours = logging.getLogger("mtp_fsm")  # the audio report goes through logging (ours only, not transitions')
    if not ours.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        ours.addHandler(handler)
    if ours.getEffectiveLevel() > logging.INFO:
        ours.setLevel(logging.INFO)
    decoder = load_decoder(args.model, seed=args.seed)
    wavs = WavWriter(os.path.join(args.out, "audio"), decoder.sample_rate)
    return AudioStream(decoder, wavs.on_audio, frame_width=engine.spec.frame_width), wavs


def _report_audio(audio, wavs, metrics, out: str) -> bool:
    """Log the audio summary; True when a request's audio failed."""
    import logging

    from .serving.audio_metrics import summarize

    log = logging.getLogger("mtp_fsm.demo")
    summary = summarize(audio, metrics)
    for line in summary.lines():
        log.info("%s", line)
    log.info("wrote %d WAV files to %s (%d Hz, %d samples a frame)", len(wavs.paths), os.path.join(out, "audio"),
             audio.timing.sample_rate, audio.timing.samples_per_frame)
    for rid, stats in audio.stats.items():
        if stats.error:
            log.error("%s", stats.error)
    return summary.errors > 0


def speculation_line(stats, frames: int, steps: int) -> str:
    """The demo's speculation summary: acceptance and what it bought."""
    return (f"speculation: k={stats.num_drafts}, acceptance rate {stats.acceptance_rate:.3f} "
            f"({stats.accepted}/{stats.proposed} drafts), {stats.drafts_per_row:.2f} drafts and "
            f"{stats.frames_per_row:.2f} frames per verify row, "
            f"{frames / max(steps, 1):.2f} frames per engine step ({frames} frames, {steps} steps)")


def report_demo(metrics, chunker, num_chunks: int, out: str, title: str) -> None:
    """The demo's ending, whichever backend ran it: states plot, summary table, chunk count."""
    from .serving.plots import plot_states

    plot_states(metrics, os.path.join(out, "states.png"), title=title)
    summary = metrics.summary()
    print(summary.table())
    width = max(len(label) for label, _ in summary.rows())
    print(f"{'audio chunks':<{width}}  {num_chunks} (first chunks of {chunker.first_chunk} frames, "
          f"then {chunker.chunk})")
    print(f"wrote {os.path.join(out, 'states.png')} and {os.path.join(out, 'frames.jsonl')}")


class _Progress:
    """The demo's progress bar on stderr (tqdm): requests finished, with the step and frames."""

    def __init__(self, total: int, loop, enabled: bool = True) -> None:
        from tqdm import tqdm

        self.loop = loop
        self.bar = tqdm(total=max(total, 1), unit="req", desc="requests", disable=not enabled, file=sys.stderr)

    def update(self, output) -> None:
        self.bar.update(self.loop.metrics.num_finished - self.bar.n)
        self.bar.set_postfix(step=output.step + 1, frames=self.loop.metrics.total_frames, refresh=False)

    def close(self) -> None:
        self.bar.close()


if __name__ == "__main__":
    sys.exit(main())
