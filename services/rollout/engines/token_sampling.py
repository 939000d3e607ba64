"""Raw token sampling for training sessions: n completions of one prompt, with stop tokens.

The engine stops by itself at eos; a session may name more stop tokens, so each completion is
cut after the first of them (kept, as the sampler emitted it). Cutting after the fact samples
exactly the same distribution as stopping there, since every token depends only on those
before it; only the tokens past the cut are wasted work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from opentinker.errors import InvalidArgumentError
from opentinker.services.rollout.engines.engine import GenerationEngine
from opentinker.spec import SamplingParams

MAX_SAMPLES = 1024


@dataclass(frozen=True)
class SampledTokens:
    """One completion: ``token_ids`` (stop token included) and their sampling ``logprobs``;
    ``stopped`` is False when the token budget ended it."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool


def check_token_ids(engine: GenerationEngine, ids: Sequence[int], field: str) -> None:
    """InvalidArgumentError naming ``field`` when an id is outside the engine's vocabulary
    (the model would fail on it with an index error)."""
    vocab = len(engine.tokenizer)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidArgumentError(
            f"{field} has ids outside the vocabulary 0..{vocab - 1}: {bad[:3]}",
            code="INVALID_ARGUMENT",
        )


def check_context_length(engine: GenerationEngine, tokens: int, asked: str, fix: str) -> None:
    """InvalidArgumentError when a call would run ``tokens`` past the engine's context length,
    as vLLM refuses past max_model_len: checked before any work, since one call of millions of
    ids would take the memory of every job on the engine. asked: what makes up the count."""
    if tokens > engine.max_model_len:
        raise InvalidArgumentError(
            f"{asked}: more than the model's context length of {engine.max_model_len} tokens; "
            f"{fix}",
            code="INVALID_ARGUMENT",
        )


def sample_tokens(
    engine: GenerationEngine,
    prompt: Sequence[int],
    *,
    num_samples: int,
    sampling: SamplingParams,
    stop_token_ids: Sequence[int],
    seed: int,
    greedy: bool = False,
) -> list[SampledTokens]:
    """``num_samples`` completions of ``prompt`` from ``engine`` (deterministic per seed;
    ``greedy``: argmax decoding, logprobs at temperature 1)."""
    if not prompt:
        raise InvalidArgumentError("prompt_tokens is empty", code="INVALID_ARGUMENT")
    if not 1 <= num_samples <= MAX_SAMPLES:
        raise InvalidArgumentError(
            f"num_samples must be 1..{MAX_SAMPLES}, got {num_samples}", code="INVALID_ARGUMENT"
        )
    new = sampling.max_new_tokens
    check_context_length(
        engine,
        len(prompt) + new,
        f"{len(prompt)} prompt_tokens + {new} sampling.max_new_tokens = {len(prompt) + new} tokens",
        "shorten the prompt or lower max_new_tokens",
    )
    check_token_ids(engine, prompt, "prompt_tokens")
    eos = engine.tokenizer.eos_token_id
    stops = {*stop_token_ids, *([eos] if eos is not None else [])}
    completions = engine.generate([list(prompt)] * num_samples, sampling, seed, greedy=greedy)
    out = []
    for c in completions:
        cut = next((i + 1 for i, t in enumerate(c.token_ids) if t in stops), None)
        end = cut if cut is not None else len(c.token_ids)
        out.append(SampledTokens(c.token_ids[:end], c.logprobs[:end], stopped=cut is not None))
    return out
