"""vLLM's output objects -> our domain types, with no vLLM import (testable on CPU).

The fields read here are vLLM's documented ones (``vllm.outputs``): a ``RequestOutput`` has
``outputs`` (one ``CompletionOutput`` per sample) and ``prompt_logprobs``; a
``CompletionOutput`` has ``token_ids``, ``logprobs`` (one ``{token_id: Logprob}`` dict per
generated token, holding at least the sampled token), ``finish_reason`` ("stop" | "length")
and ``stop_reason``. A ``Logprob`` has ``logprob`` (float). Only these are relied on, through
the Protocols below, so a vLLM release that changes them fails here with a message naming the
field rather than deep in the agent loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

from opentinker.services.rollout.types import Completion


class VllmOutputError(RuntimeError):
    """vLLM answered something this adapter cannot turn into a Completion (names the field)."""


class LogprobLike(Protocol):
    logprob: float


class CompletionOutputLike(Protocol):
    token_ids: Sequence[int]
    logprobs: Sequence[Mapping[int, LogprobLike]] | None
    finish_reason: str | None


class RequestOutputLike(Protocol):
    outputs: Sequence[CompletionOutputLike]
    prompt_logprobs: Sequence[Mapping[int, LogprobLike] | None] | None


def completion_from_output(output: CompletionOutputLike, *, eos_token_id: int) -> Completion:
    """One vLLM sample as a Completion: its token ids and each one's sampled logprob.

    vLLM keeps the stop token in ``token_ids`` (our contract: a completion the model ended
    itself ends with eos); a "stop" finish whose last token is not eos is refused, since the
    engine only ever asks vLLM to stop at eos.
    """
    ids = [int(t) for t in output.token_ids]
    if output.logprobs is None:
        raise VllmOutputError(
            "CompletionOutput.logprobs is None: the request was sent without "
            "SamplingParams(logprobs=0)"
        )
    if len(output.logprobs) != len(ids):
        raise VllmOutputError(
            f"CompletionOutput.logprobs has {len(output.logprobs)} entries for "
            f"{len(ids)} token_ids; expected one per generated token"
        )
    logprobs = [
        _logprob_of(entry, token, f"logprobs[{t}]")
        for t, (entry, token) in enumerate(zip(output.logprobs, ids, strict=True))
    ]
    if output.finish_reason == "stop" and (not ids or ids[-1] != eos_token_id):
        raise VllmOutputError(
            f"CompletionOutput finished with 'stop' but its last token is "
            f"{ids[-1] if ids else None}, not eos {eos_token_id}; was a stop string or another "
            f"stop token set?"
        )
    return Completion(token_ids=ids, logprobs=logprobs)


def completions_from_outputs(
    request_outputs: Sequence[RequestOutputLike], *, eos_token_id: int
) -> list[Completion]:
    """One Completion per request, in request order (one sample per request)."""
    out = []
    for i, request in enumerate(request_outputs):
        if len(request.outputs) != 1:
            raise VllmOutputError(
                f"RequestOutput {i} has {len(request.outputs)} outputs; the engine asks for n=1"
            )
        out.append(completion_from_output(request.outputs[0], eos_token_id=eos_token_id))
    return out


def prompt_logprobs_from_output(
    request: RequestOutputLike, token_ids: Sequence[int]
) -> list[float]:
    """log p(ids[i+1] | ids[:i+1]) from a request sent with ``prompt_logprobs=0``: vLLM's list
    has one entry per prompt token, None first (the first token has no context)."""
    entries = request.prompt_logprobs
    if entries is None:
        raise VllmOutputError(
            "RequestOutput.prompt_logprobs is None: send SamplingParams(prompt_logprobs=0)"
        )
    if len(entries) != len(token_ids):
        raise VllmOutputError(
            f"RequestOutput.prompt_logprobs has {len(entries)} entries for a "
            f"{len(token_ids)}-token prompt"
        )
    return [
        _logprob_of(entry, int(token), f"prompt_logprobs[{i}]")
        for i, (entry, token) in enumerate(zip(entries, token_ids, strict=True))
        if i > 0
    ]


def _logprob_of(entry: Mapping[int, LogprobLike] | None, token: int, where: str) -> float:
    if entry is None or token not in entry:
        raise VllmOutputError(f"{where} holds no logprob for token {token}")
    value = float(entry[token].logprob)
    if not math.isfinite(value):  # -inf too: the trainer's ratio exp(new - old) would be inf
        raise VllmOutputError(f"{where}: the logprob of token {token} is {value}")
    return value
