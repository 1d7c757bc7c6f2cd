"""A request's mtp_fsm fields as a plain dict for `SamplingParams.extra_args` (frontend -> worker)."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ..engine.plan import NewRequest
from ..errors import AdmissionError
from ..sampling import SamplingParams

# The key under `extra_args`; the version guards a worker against a frontend of another layout.
EXTRA_ARGS_KEY = "mtp_fsm"
CODEC_VERSION = 1
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty")


class RequestCodecError(AdmissionError):
    """The request's extra_args cannot be turned back into an mtp_fsm request."""


def _encode_value(value: Any) -> Any:
    # extra_args crosses processes as msgpack: tensors and tuples need a tagged form.
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        return {"__tensor__": {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                               "data": tensor.reshape(-1).tolist()}}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode_value(v) for v in value]}
    if isinstance(value, list):
        return [_encode_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot carry a {type(value).__name__} in vLLM extra_args")


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__tensor__"}:
        spec = value["__tensor__"]
        dtype = getattr(torch, spec["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown tensor dtype {spec['dtype']!r}")
        return torch.tensor(spec["data"], dtype=dtype).reshape(spec["shape"])
    if isinstance(value, dict) and set(value) == {"__tuple__"}:
        return tuple(_decode_value(v) for v in value["__tuple__"])
    if isinstance(value, list):
        return [_decode_value(v) for v in value]
    return value


def encode_request(request: NewRequest) -> dict[str, Any]:
    """The fields vLLM does not carry itself (max_frames travels as `max_tokens`)."""
    if request.sampling_width != 1:
        raise RequestCodecError(request.request_id, f"sampling_width {request.sampling_width} is not served by vLLM "
                                "(one CB0 token per step)")
    inputs = request.inputs
    if not attrs.has(type(inputs)):
        raise RequestCodecError(request.request_id, f"inputs of type {type(inputs).__name__} are not an attrs class; "
                                "the vLLM route carries attrs inputs field by field")
    try:
        fields = {f.name: _encode_value(getattr(inputs, f.name)) for f in attrs.fields(type(inputs)) if f.init}
    except TypeError as exc:
        raise RequestCodecError(request.request_id, f"inputs: {exc}") from exc
    return {
        "version": CODEC_VERSION,
        "request_id": request.request_id,
        "inputs_type": f"{type(inputs).__module__}:{type(inputs).__qualname__}",
        "inputs": fields,
        "seed": request.seed,
        "min_frames": request.min_frames,
        "cb0_sampling": {name: getattr(request.cb0_sampling, name) for name in _SAMPLING_FIELDS},
        "mtp_sampling": {name: getattr(request.mtp_sampling, name) for name in _SAMPLING_FIELDS},
    }


def decode_request(request_id: str, payload: Any, *, max_frames: int, inputs_type: type) -> NewRequest:
    """Rebuild the NewRequest under the worker's id. `inputs_type` is the talker's own inputs
    class: the payload may name only that class (a request cannot make the worker build
    anything else)."""
    if not isinstance(payload, dict):
        raise RequestCodecError(request_id, f"extra_args[{EXTRA_ARGS_KEY!r}] is missing or not a dict; submit through "
                                "mtp_fsm.vllm (or encode_request)")
    if payload.get("version") != CODEC_VERSION:
        raise RequestCodecError(request_id, f"extra_args layout version {payload.get('version')!r}, this worker reads "
                                f"{CODEC_VERSION}")
    expected = f"{inputs_type.__module__}:{inputs_type.__qualname__}"
    if payload.get("inputs_type") != expected:
        raise RequestCodecError(request_id, f"inputs of type {payload.get('inputs_type')!r}; this talker takes "
                                f"{expected}")
    try:
        inputs = inputs_type(**{k: _decode_value(v) for k, v in dict(payload["inputs"]).items()})
        return NewRequest(
            request_id=request_id, inputs=inputs, max_frames=max_frames, seed=payload["seed"],
            min_frames=payload["min_frames"],
            cb0_sampling=SamplingParams(**payload["cb0_sampling"]),
            mtp_sampling=SamplingParams(**payload["mtp_sampling"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RequestCodecError(request_id, f"extra_args cannot be decoded: {type(exc).__name__}: {exc}") from exc


def with_vllm_rules(request: NewRequest, params: Any) -> NewRequest:
    """vLLM's own repetition_penalty / min_tokens become the engine's when the request left
    them unset: the worker never runs vLLM's sampler, so nothing is applied twice."""
    penalty = getattr(params, "repetition_penalty", 1.0)
    if request.cb0_sampling.repetition_penalty is None and penalty not in (None, 1.0):
        request = attrs.evolve(request, cb0_sampling=attrs.evolve(request.cb0_sampling, repetition_penalty=penalty))
    min_tokens = getattr(params, "min_tokens", 0)
    if request.min_frames is None and min_tokens:
        request = attrs.evolve(request, min_frames=int(min_tokens))
    return request
