"""The rollout's token-level RPCs (SampleTokens, ScoreTokens) take no more tokens than the
model's context length: a longer request is the caller's INVALID_ARGUMENT, naming the count,
the limit and the fix (as vLLM refuses past max_model_len), before any forward pass. On a
shared rollout one tenant's 16M-token call would otherwise OOM the process and fail every job
on the engine. A refused call costs the session nothing: the next calls are answered."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path

import grpc
import pytest
from rollout_helpers import session_rollout

from opentinker.common.v1 import common_pb2
from opentinker.rollout.v1 import rollout_pb2
from opentinker.services.modeling.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.integration

CONTEXT = 4096  # the tiny Qwen2's max_position_embeddings


def _sample(prompt: list[int], max_new_tokens: int) -> rollout_pb2.SampleTokensRequest:
    sampling = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens)
    return rollout_pb2.SampleTokensRequest(
        prompt_tokens=prompt, num_samples=1, sampling=sampling, seed=1
    )


async def _refused(call: Awaitable[object]) -> str:
    """The details of a call that must end INVALID_ARGUMENT."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details() or ""


def test_token_calls_past_the_context_length_are_refused_and_the_session_goes_on(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with session_rollout(ensure_tiny_model(tmp_path / "tiny-qwen2")) as stub:
            score = stub.ScoreTokens(
                rollout_pb2.ScoreTokensRequest(token_ids=[1] * (CONTEXT + 1)), timeout=30
            )
            detail = await _refused(score)
            assert f"{CONTEXT + 1} token_ids" in detail and f"{CONTEXT} tokens" in detail
            assert "split" in detail  # the fix

            # Prompt + the tokens asked for: 4090 + 8 = 4098, past 4096.
            detail = await _refused(stub.SampleTokens(_sample([1] * 4090, 8), timeout=30))
            assert "4090 prompt_tokens + 8 sampling.max_new_tokens = 4098" in detail
            assert f"{CONTEXT} tokens" in detail and "max_new_tokens" in detail

            # Nothing was lost: calls up to the limit itself are answered.
            scored = await stub.ScoreTokens(
                rollout_pb2.ScoreTokensRequest(token_ids=[1, 2] * (CONTEXT // 2)), timeout=60
            )
            assert len(scored.logprobs) == CONTEXT - 1
            sampled = await stub.SampleTokens(_sample([1] * (CONTEXT - 4), 4), timeout=60)
            assert len(sampled.samples) == 1 and 1 <= len(sampled.samples[0].token_ids) <= 4

    asyncio.run(asyncio.wait_for(main(), 180))
