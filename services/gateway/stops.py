"""Stop strings: Tinker's ``SamplingParams.stop`` given as text.

The rollout engine stops on token ids; a stop string is applied here, on the sampled tokens,
with the base model's own tokenizer: a sequence ends with the token that completes the first
stop string in its text, that token included (Tinker returns the stop sequence's tokens, as
stop tokens are: the cookbook's renderers find it in the tokens they parse), stop reason
``stop``. Cutting after sampling gives exactly the tokens a sampler stopping there would
have: each token depends only on those before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from transformers import AutoTokenizer

from opentinker.errors import InvalidArgumentError
from opentinker.training_session import SampledSequence, SampleOutput

Decode = Callable[[list[int]], str]


def parse_stop(stop: str | Sequence[Any] | None) -> tuple[list[int], list[str]]:
    """(stop token ids, stop strings) of SamplingParams.stop: one kind or the other."""
    if stop is None:
        return [], []
    if isinstance(stop, str):
        stop = [stop]
    if all(isinstance(s, int) for s in stop):
        return [int(s) for s in stop], []
    if all(isinstance(s, str) for s in stop):
        if any(not s for s in stop):
            raise InvalidArgumentError("sampling_params.stop: an empty stop string")
        return [], list(stop)
    raise InvalidArgumentError("sampling_params.stop: all token ids or all strings, not a mix")


def cut_at_stop(seq: SampledSequence, stops: Sequence[str], decode: Decode) -> SampledSequence:
    """``seq`` up to and including the token that completes the first stop string."""
    # A stop string ends within the text of the last few tokens: look back far enough that
    # the window holds the longest one whole (every token is at least one byte).
    window = max(len(s.encode()) for s in stops) + 1
    for end in range(1, len(seq.tokens) + 1):  # the first window holding one: its last token
        if any(s in decode(seq.tokens[max(0, end - window) : end]) for s in stops):  # completes it
            return replace(
                seq,
                tokens=seq.tokens[:end],
                logprobs=seq.logprobs[:end],
                top_logprobs=seq.top_logprobs[:end],
                stop_reason="stop",
            )
    return seq


def apply_stop_strings(output: SampleOutput, stops: Sequence[str], decode: Decode) -> SampleOutput:
    if not stops:
        return output
    return replace(output, sequences=[cut_at_stop(s, stops, decode) for s in output.sequences])


class Tokenizers:
    """The base models' tokenizers (from the directory a base name maps to), loaded once."""

    def __init__(self) -> None:
        self._by_path: dict[str, Any] = {}

    async def decoder(self, path: str) -> Decode:
        tokenizer = await self.tokenizer(
            path, need="sampling_params.stop: stop strings", instead="give stop token ids instead"
        )
        return lambda ids: tokenizer.decode(ids)

    async def tokenizer(self, path: str, *, need: str, instead: str) -> Any:
        """The tokenizer at ``path``; InvalidArgumentError saying what ``need``s it (a field:
        what) and what to do ``instead`` when there is none."""
        if path not in self._by_path:
            try:
                tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path)
            except OSError as err:
                raise InvalidArgumentError(
                    f"{need} need the base model's tokenizer, and {path!r} has none here "
                    f"({err}); {instead}"
                ) from err
            self._by_path[path] = tokenizer
        return self._by_path[path]
