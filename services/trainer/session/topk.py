"""Top-k logprobs of a Sample call (Tinker's topk_prompt_logprobs / topk_sample_logprobs),
scored by the sampler that made the samples, with the weights it serves for them."""

from __future__ import annotations

from opentinker.errors import InvalidArgumentError
from opentinker.services.trainer.session.sampler import SessionSampler
from opentinker.trainer.v1 import trainer_pb2

MAX_TOPK = 64  # the rollout's bound (ScoreTokensRequest.top_k)


def check_topk(request: trainer_pb2.SampleRequest) -> None:
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        k = getattr(request, name)
        if not 0 <= k <= MAX_TOPK:
            raise InvalidArgumentError(f"{name}: {k} is outside 0..{MAX_TOPK}")


async def add_topk(
    sampler: SessionSampler,
    request: trainer_pb2.SampleRequest,
    response: trainer_pb2.SampleResponse,
    *,
    timeout_s: float,
) -> None:
    """Fill the response's top-k fields the request asks for: the prompt's rows (one per
    prompt token after the first) and each sequence's rows (one per sampled token)."""
    prompt = list(request.prompt_tokens)
    if request.topk_prompt_logprobs and len(prompt) > 1:
        ids, logprobs = await sampler.score_top(
            prompt, request.topk_prompt_logprobs, timeout_s=timeout_s
        )
        response.topk_prompt_token_ids.extend(ids)
        response.topk_prompt_logprobs.extend(logprobs)
    k = request.topk_sample_logprobs
    if not k:
        return
    for seq in response.sequences:
        if not seq.tokens:
            continue
        ids, logprobs = await sampler.score_top([*prompt, *seq.tokens], k, timeout_s=timeout_s)
        skip = (len(prompt) - 1) * k  # the rows of positions that predict prompt tokens
        seq.topk_token_ids.extend(ids[skip:])
        seq.topk_logprobs.extend(logprobs[skip:])
