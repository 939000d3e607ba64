"""Sampling a sampler snapshot: the one path both front doors take, Tinker's ``asample`` and
the OpenAI-compatible completions (openai_routes.py). The request is checked first (a bad
field is an InvalidArgumentError naming it, whatever the sampler), then sampled on the trainer
session's rollout engine with the snapshot's policy version."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentinker.errors import InvalidArgumentError
from opentinker.services.gateway import wire
from opentinker.services.gateway.futures import Result
from opentinker.services.gateway.models import TrainingModel
from opentinker.services.gateway.state import Gateway
from opentinker.services.gateway.stops import apply_stop_strings, parse_stop
from opentinker.services.gateway.tenancy import Caller
from opentinker.spec import SamplingParams
from opentinker.training_session import SampleOutput


@dataclass(frozen=True)
class SampleCall:
    """A checked sampling request: ``prompt`` ids, ``num_samples`` completions drawn with
    ``sampling`` (argmax when ``greedy``), stopping at ``stop_ids`` or after the text of one
    of ``stop_strings``; ``with_prompt``: also the prompt's logprobs."""

    prompt: list[int]
    num_samples: int
    sampling: SamplingParams
    greedy: bool
    stop_ids: list[int]
    stop_strings: list[str]
    seed: int
    with_prompt: bool = False
    topk_prompt: int = 0  # the k likeliest tokens at each prompt position (0: none)
    topk_sample: int = 0  # .. at each sampled token


def sample_call(
    prompt: list[int],
    params: Mapping[str, Any],
    *,
    num_samples: Any = 1,
    with_prompt: bool = False,
    topk_prompt: Any = 0,
    topk_sample: Any = 0,
) -> SampleCall:
    """A SampleCall of Tinker's sampling_params (temperature, top_p, top_k, max_tokens, stop,
    seed) and top-k asks; InvalidArgumentError names each bad field."""
    sampling, greedy = wire.sampling_params(params)
    stop_ids, stop_strings = parse_stop(params.get("stop"))
    return SampleCall(
        prompt=prompt,
        num_samples=wire.check_num_samples(num_samples),
        sampling=sampling,
        greedy=greedy,
        stop_ids=stop_ids,
        stop_strings=stop_strings,
        seed=wire.session_seed(params.get("seed")),
        with_prompt=with_prompt,
        topk_prompt=wire.check_topk("topk_prompt_logprobs", topk_prompt),
        topk_sample=wire.check_topk("topk_sample_logprobs", topk_sample),
    )


async def sample(gw: Gateway, model: TrainingModel, version: int, call: SampleCall) -> SampleOutput:
    """``call`` sampled from ``model``'s snapshot ``version`` (stop strings applied)."""
    if call.stop_strings:  # the tokenizer first: a base without one is refused before sampling
        decode = await gw.tokenizers.decoder(base_path(gw, model))
    output = await asyncio.wrap_future(
        model.session.sample_async(
            call.prompt,
            num_samples=call.num_samples,
            sampling=call.sampling,
            stop_token_ids=call.stop_ids,
            seed=call.seed,
            include_prompt_logprobs=call.with_prompt or bool(call.topk_prompt),
            policy_version=version,
            greedy=call.greedy,
            topk_prompt_logprobs=call.topk_prompt,
            topk_sample_logprobs=call.topk_sample,
        )
    )
    if call.stop_strings:
        output = apply_stop_strings(output, call.stop_strings, decode)
    return output


def base_path(gw: Gateway, model: TrainingModel) -> str:
    """What the pool loads for the model's base (its tokenizer is there)."""
    return gw.settings.base_models.get(model.base_model, model.base_model)


async def asample(gw: Gateway, caller: Caller, body: dict) -> dict:
    """Tinker's asample: a future of the sampler's samples (SampleResponse protobuf)."""
    if not body.get("sampling_session_id"):
        raise InvalidArgumentError(
            "sampling_session_id: sample from a sampling client of a training client's weights"
        )
    with_prompt = bool(body.get("prompt_logprobs"))
    last_n = body.get("prompt_logprobs_last_n")
    prompt = wire.prompt_tokens(body["prompt"])
    call = sample_call(
        prompt,
        body.get("sampling_params") or {},
        num_samples=body.get("num_samples", 1),
        with_prompt=with_prompt,
        topk_prompt=body.get("topk_prompt_logprobs") or 0,
        topk_sample=body.get("topk_sample_logprobs") or 0,
    )
    scored = with_prompt or bool(call.topk_prompt)
    wire.check_prompt_logprobs_last_n(last_n, scored=scored, prompt_len=len(prompt))
    model, version = gw.models.sampler(body["sampling_session_id"], caller)
    if call.stop_strings:  # refused now, not in the future, when the base has no tokenizer
        await gw.tokenizers.decoder(base_path(gw, model))
    ids: list[str] = []

    async def work() -> Result:
        output = await sample(gw, model, version, call)
        if body.get("record_stability_info"):
            model.stability.record_sample(ids, prompt, output.sequences)
        scored = wire.prompt_logprobs(output.prompt_logprobs, last_n) if with_prompt else None
        top = wire.prompt_top_rows(output, last_n) if call.topk_prompt else None
        return Result(wire.sample_response(output, prompt_logprobs=scored, prompt_top=top))

    request_id = gw.futures.start(work(), tenant=caller.tenant_id)
    ids.extend(f"{request_id}:{i}" for i in range(call.num_samples))
    return {"request_id": request_id, "sample_sequence_ids": ids}
