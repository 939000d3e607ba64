"""Tinker's wire formats <-> the trainer session's messages.

The protobuf schema is the one the ``tinker`` SDK ships (``tinker.proto.tinker_public_pb2``),
imported rather than copied, so the gateway reads and writes exactly what the pinned SDK does:
forward_backward requests and their outputs, and sample results, are protobuf; everything
else is JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import ValidationError
from tinker.proto import tinker_public_pb2 as tinker_pb

from opentinker.errors import InvalidArgumentError
from opentinker.spec import LoraConfig, SamplingParams, validation_message
from opentinker.training_session import Datum, ForwardOutput, SampleOutput

# Tinker loss names the trainer implements, and the loss_fn_config keys each one takes.
SUPPORTED_LOSSES: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset(),
    "importance_sampling": frozenset(),
    "ppo": frozenset({"clip_low_threshold", "clip_high_threshold"}),
    "cispo": frozenset({"clip_low_threshold", "clip_high_threshold"}),
    "gspo": frozenset({"clip_low_threshold", "clip_high_threshold"}),
    "stable_reinforce": frozenset({"kl_coeff"}),
    "dro": frozenset({"beta"}),  # the trainer's kl_coeff: the weight of its quadratic penalty
}
# loss_fn_inputs name -> our Datum field (target_tokens is the datum's targets).
_INPUT_FIELDS = {
    "weights": "weights",
    "logprobs": "sampling_logprobs",
    "advantages": "advantages",
    "sequence_ratio_mask": "sequence_ratio_mask",
}
_NUMPY_DTYPES = {tinker_pb.DTYPE_FLOAT32: np.float32, tinker_pb.DTYPE_INT64: np.int64}
# Our metric names without a reduction get the one the SDK should fold chunks with.
_REDUCTIONS = {"clip_fraction": "mean", "truncated_fraction": "mean"}
_STOP_REASONS = {"stop": tinker_pb.STOP_REASON_STOP, "length": tinker_pb.STOP_REASON_LENGTH}
# The JSON fields the routes read, by the type the SDK sends (each may also be null).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(
        ("session_id", "model_id", "request_id", "sampling_session_id", "base_model", "path"),
        (str,),
    ),
    "model_path": (str,),
    "user_metadata": (dict,),
    **dict.fromkeys(("seq_id", "model_seq_id", "num_samples", "prompt_logprobs_last_n"), (int,)),
    "ttl_seconds": (float, int),
    **dict.fromkeys(("lora_config", "adam_params", "sampling_params", "prompt"), (dict,)),
}
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", dict: "an object"}


def check_json_body(body: Any) -> dict:
    """A JSON request body: an object whose known fields have the types the SDK sends
    (InvalidArgumentError naming the first that does not), so a handler never trips on one."""
    if not isinstance(body, dict):
        raise InvalidArgumentError(f"body: a JSON object expected, not {type(body).__name__}")
    for name, types in _FIELD_TYPES.items():
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise InvalidArgumentError(f"{name}: {_TYPE_NAMES[types[0]]} expected, not {value!r}")
    return body


def parse_forward_backward(body: bytes) -> tinker_pb.ForwardBackwardRequest:
    request = tinker_pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as err:  # protobuf's DecodeError
        raise InvalidArgumentError(f"body: not a ForwardBackwardRequest protobuf ({err})") from err
    return request


def loss_config(request: tinker_pb.ForwardBackwardRequest) -> dict[str, float]:
    """The request's loss_fn_config: v2 (tagged values) when set, else the legacy float map."""
    if not request.loss_fn_config_v2:
        return dict(request.loss_fn_config)
    text = sorted(
        k for k, v in request.loss_fn_config_v2.items() if v.WhichOneof("value") != "number"
    )
    if text:
        raise InvalidArgumentError(f"loss_fn_config: {text} must be numbers")
    return {k: v.number for k, v in request.loss_fn_config_v2.items()}


def loss_options(loss_fn: str, config: Mapping[str, float]) -> dict[str, float]:
    """The trainer's loss options for a Tinker loss; InvalidArgumentError names what is wrong."""
    if loss_fn not in SUPPORTED_LOSSES:
        raise InvalidArgumentError(
            f"loss_fn: {loss_fn!r} is not supported here; use one of {sorted(SUPPORTED_LOSSES)}"
        )
    unknown = set(config) - SUPPORTED_LOSSES[loss_fn]
    if unknown:
        raise InvalidArgumentError(f"loss_fn_config: {sorted(unknown)} unknown for {loss_fn}")
    return {("kl_coeff" if k == "beta" else k): float(v) for k, v in config.items()}


def session_data(request: tinker_pb.ForwardBackwardRequest) -> list[Datum]:
    return [_datum(i, d) for i, d in enumerate(request.data)]


def _datum(index: int, datum: tinker_pb.Datum) -> Datum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise InvalidArgumentError(f"data[{index}].model_input: only token chunks are served")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    inputs = {name: _tensor(index, name, t) for name, t in datum.loss_fn_inputs.items()}
    if "target_tokens" not in inputs:
        raise InvalidArgumentError(f"data[{index}].loss_fn_inputs: target_tokens is required")
    values = {
        field: [float(v) for v in inputs[name]]
        for name, field in _INPUT_FIELDS.items()
        if name in inputs
    }
    return Datum(
        input_tokens=tokens, target_tokens=[int(t) for t in inputs["target_tokens"]], **values
    )


def _tensor(index: int, name: str, tensor: tinker_pb.Tensor) -> list[Any]:
    dtype = _NUMPY_DTYPES.get(tensor.dtype)
    if dtype is None or tensor.HasField("sparse_csr"):
        raise InvalidArgumentError(
            f"data[{index}].loss_fn_inputs[{name!r}]: only dense float32/int64 tensors are served"
        )
    return np.frombuffer(tensor.dense, dtype=dtype).tolist()


def forward_backward_output(output: ForwardOutput) -> bytes:
    """The SDK's ForwardBackwardOutput: one ArrayRecord with each datum's target logprobs."""
    proto = tinker_pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = proto.loss_fn_outputs.add(num_datums=len(output.logprobs))
    arrays = [np.asarray(lp, dtype=np.float32) for lp in output.logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
    logprobs = record.fields["logprobs"]
    logprobs.dtype = tinker_pb.DTYPE_FLOAT32
    logprobs.data = b"".join(a.tobytes() for a in arrays)
    logprobs.offsets = offsets.tobytes()
    for name, value in sdk_metrics(output.metrics).items():
        proto.metrics[name] = value
    return proto.SerializeToString()


def sdk_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Metric names as the SDK folds them: ``name:reduction`` (sum unless known otherwise)."""
    return {
        name if ":" in name else f"{name}:{_REDUCTIONS.get(name, 'sum')}": float(value)
        for name, value in metrics.items()
    }


def prompt_logprobs(scored: Sequence[float], last_n: int | None) -> list[float]:
    """Tinker's prompt logprobs: one per prompt token, NaN (None to the SDK) for the first and,
    with ``last_n``, for all but the last ``last_n`` tokens."""
    values = [float("nan"), *scored]
    if last_n:
        keep = len(values) - int(last_n)
        values = [float("nan")] * keep + values[keep:]
    return values


def session_seed(seed: int | None) -> int:
    """The trainer's sample seed of a Tinker seed. The trainer reads 0 as none given (a seed
    derived from the call), so every given seed, 0 included, maps to one of 1..2**64-1: the
    same seed gives the same draws, as in Tinker."""
    if seed is None:
        return 0
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidArgumentError(f"sampling_params.seed: an integer expected, not {seed!r}")
    return seed % (2**64 - 1) + 1


# Samples of one asample call: its reply (tokens and logprobs of each) is held in the
# gateway's memory until retrieved, so it is bounded (the rollout's own limit too).
MAX_NUM_SAMPLES = 1024


def sampling_params(params: Mapping[str, Any]) -> tuple[SamplingParams, bool]:
    """Tinker's sampling_params as ours, and whether to decode greedily: temperature 0 is
    argmax decoding (the cookbook's greedy evals; logprobs then at temperature 1).
    InvalidArgumentError names each bad field."""
    check_top_k(params.get("top_k"))
    temperature = params.get("temperature", 1.0)
    greedy = temperature == 0 and not isinstance(temperature, bool)
    fields = {
        "temperature": 1.0 if greedy else temperature,
        "top_p": params.get("top_p", 1.0),
        **({"max_new_tokens": params["max_tokens"]} if params.get("max_tokens") else {}),
    }
    try:
        return SamplingParams(**fields), greedy
    except ValidationError as err:
        names = {"max_new_tokens": "max_tokens"}
        problems = [
            f"sampling_params.{names.get(str(p['loc'][0]), p['loc'][0])}: {p['msg']}"
            f" (got {p.get('input')!r})"
            for p in err.errors()
        ]
        raise InvalidArgumentError("; ".join(problems)) from err


# Tinker's LoRA switches -> the modules they add LoRA to (Qwen / Llama module names).
LORA_MODULES = {
    "train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "train_mlp": ("gate_proj", "up_proj", "down_proj"),
    "train_unembed": ("lm_head",),
}
_LORA_KEYS = {"rank", "seed", *LORA_MODULES}


def lora_config(config: Mapping[str, Any], *, unembed: bool) -> tuple[LoraConfig, int]:
    """Tinker's lora_config as ours (rank; target modules from train_attn / train_mlp /
    train_unembed, each true by default as in the SDK; train_unembed only with ``unembed``,
    see GatewaySettings.unembed_lora) and the seed of the LoRA init (None: 0).
    InvalidArgumentError names each bad field."""
    unknown = sorted(set(config) - _LORA_KEYS)
    if unknown:
        raise InvalidArgumentError(f"lora_config: unknown field(s) {unknown}")
    rank = config.get("rank") or 0
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidArgumentError(
            f"lora_config.rank: {rank!r}; an integer >= 1 is required (LoRA training only)"
        )
    for switch in LORA_MODULES:
        if not isinstance(config.get(switch, True), bool):
            raise InvalidArgumentError(
                f"lora_config.{switch}: true or false, not {config[switch]!r}"
            )
    served = {**config, "train_unembed": unembed and config.get("train_unembed", True)}
    modules = [
        m for switch, names in LORA_MODULES.items() if served.get(switch, True) for m in names
    ]
    if not modules:
        raise InvalidArgumentError(
            "lora_config: nothing to train: train_attn and train_mlp are false"
            + ("" if unembed else " (train_unembed is not served here: unembed_lora is off)")
        )
    seed = config.get("seed")
    seed = 0 if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise InvalidArgumentError(f"lora_config.seed: an integer in 0..2**63-1, not {seed!r}")
    try:
        return LoraConfig(rank=rank, target_modules=tuple(modules)), seed
    except ValidationError as err:
        raise InvalidArgumentError(f"lora_config: {validation_message(err)}") from err


def check_num_samples(num_samples: Any) -> int:
    """``num_samples``: 1..MAX_NUM_SAMPLES (InvalidArgumentError naming it otherwise)."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int):
        raise InvalidArgumentError(f"num_samples: an integer expected, not {num_samples!r}")
    if not 1 <= num_samples <= MAX_NUM_SAMPLES:
        raise InvalidArgumentError(
            f"num_samples: {num_samples} is outside 1..{MAX_NUM_SAMPLES}; ask for more "
            "samples in several calls"
        )
    return num_samples


def check_top_k(top_k: Any) -> None:
    """The engine samples with temperature and top_p only: a top_k that would limit the draw
    is refused rather than ignored (-1, Tinker's default, and 0 mean no limit)."""
    if top_k not in (None, -1, 0):
        raise InvalidArgumentError(
            f"sampling_params.top_k: {top_k!r} is not served here (only temperature and top_p "
            "shape sampling); leave it -1, or narrow the draw with top_p"
        )


def check_prompt_logprobs_last_n(last_n: int | None, *, scored: bool, prompt_len: int) -> None:
    """Tinker's rule: ``prompt_logprobs_last_n`` asks for prompt logprobs and is 1 to
    ``len(prompt) - 1`` (the first token has none); InvalidArgumentError otherwise."""
    if last_n is None:
        return
    if not scored:
        raise InvalidArgumentError(
            "prompt_logprobs_last_n: applies to prompt logprobs; set prompt_logprobs too"
        )
    if not 1 <= last_n <= prompt_len - 1:
        raise InvalidArgumentError(
            f"prompt_logprobs_last_n: {last_n} is outside 1..{prompt_len - 1} for a prompt "
            f"of {prompt_len} tokens (the first token has no logprob)"
        )


def sample_response(
    output: SampleOutput,
    *,
    prompt_logprobs: list[float] | None = None,
    prompt_top: TopRows | None = None,
) -> bytes:
    """The SDK's SampleResponse; top-k rows (the sequences' own, and ``prompt_top``) as its
    TopkLogprobs matrices."""
    proto = tinker_pb.SampleResponse()
    if prompt_logprobs is not None:
        proto.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if prompt_top is not None:
        proto.topk_prompt_logprobs.CopyFrom(_topk(prompt_top))
    for seq in output.sequences:
        added = proto.sequences.add(
            stop_reason=_STOP_REASONS.get(seq.stop_reason, tinker_pb.STOP_REASON_LENGTH),
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
        )
        if seq.top_logprobs:
            added.topk_sampled_logprobs.CopyFrom(_topk(seq.top_logprobs))
    return proto.SerializeToString()


# Rows of top-k (token, logprob) pairs, one per position; None: a position without any
# (the prompt's first token, and those before prompt_logprobs_last_n).
TopRows = Sequence[Sequence[tuple[int, float]] | None]
MASK_LOGPROB = -99999.0  # the SDK's sentinel of an empty slot (tinker.types.topk_logprobs)
MAX_TOPK = 64  # the trainer's bound


def _topk(rows: TopRows) -> tinker_pb.TopkLogprobs:
    k = max((len(r) for r in rows if r), default=0)
    ids = np.zeros((len(rows), k), dtype=np.int32)
    logprobs = np.full((len(rows), k), MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or ()):
            ids[i, j], logprobs[i, j] = token, logprob
    return tinker_pb.TopkLogprobs(
        token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows)
    )


def prompt_top_rows(output: SampleOutput, last_n: int | None) -> list:
    """Tinker's topk_prompt_logprobs rows: one per prompt token, none for the first and,
    with ``last_n``, none for all but the last ``last_n`` tokens."""
    rows: list = [None, *output.prompt_top_logprobs]
    if last_n:
        keep = len(rows) - int(last_n)
        rows = [None] * keep + rows[keep:]
    return rows


def check_topk(name: str, k: Any) -> int:
    """A top-k ask: an integer 0..MAX_TOPK (InvalidArgumentError naming ``name``)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOPK:
        raise InvalidArgumentError(f"{name}: {k!r} is not an integer in 0..{MAX_TOPK}")
    return k


def prompt_tokens(prompt: Mapping[str, Any]) -> list[int]:
    """Token ids of a JSON ModelInput ({"chunks": [{"type": "encoded_text", "tokens": [...]}]})."""
    tokens: list[int] = []
    chunks = prompt.get("chunks", [])
    if not isinstance(chunks, list):
        raise InvalidArgumentError(f"prompt.chunks: a list expected, not {chunks!r:.80}")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise InvalidArgumentError(f"prompt.chunks[{i}]: only token chunks are served")
        ids = chunk.get("tokens", [])
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise InvalidArgumentError(f"prompt.chunks[{i}].tokens: a list of integers expected")
        tokens.extend(ids)
    if not tokens:
        raise InvalidArgumentError("prompt: no tokens")
    return tokens
