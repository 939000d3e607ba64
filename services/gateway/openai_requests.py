"""The OpenAI-compatible routes' requests (the rollout endpoint's ChatRequest, with the
sampling fields this door serves) and the pieces of their replies: choices and logprobs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from opentinker.services.gateway.wire import MAX_NUM_SAMPLES
from opentinker.services.rollout.agent_endpoint.openai_wire import ChatRequest

DEFAULT_CHAT_TOKENS = 512  # a chat reply's cap when the request gives none
DEFAULT_COMPLETION_TOKENS = 16  # as OpenAI's /v1/completions
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (5 for completions)

TokenText = Callable[[int], str]  # one token id's text


class SamplingFields(BaseModel):
    """What both routes take to shape the draw. temperature 0 is greedy (argmax) decoding."""

    model_config = ConfigDict(extra="allow")  # clients send more (user, metadata, ...)

    n: int = Field(1, ge=1, le=MAX_NUM_SAMPLES)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False

    def tinker_params(self, max_tokens: int) -> dict[str, Any]:
        """As Tinker's sampling_params (what the sampling path takes)."""
        params: dict[str, Any] = {"max_tokens": max_tokens, "stop": self.stop or None}
        if self.temperature is not None:
            params["temperature"] = self.temperature
        if self.top_p is not None:
            params["top_p"] = self.top_p
        if self.seed is not None:
            params["seed"] = self.seed
        return params


class OpenAIChatRequest(SamplingFields, ChatRequest):
    """POST /v1/chat/completions: ``model`` a base model or a tinker:// checkpoint."""

    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(SamplingFields):
    """POST /v1/completions: one prompt (text, or token ids)."""

    model: str = ""
    prompt: str | list[int] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = Field(False, description="not served: the prompt is never echoed")


def chat_logprobs(
    tokens: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]] | None,
    text: TokenText,
) -> dict[str, Any]:
    """A chat choice's ``logprobs``: per sampled token its text, bytes, logprob and (asked
    for) the top alternatives."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        piece = text(token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    content = []
    for at, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        alternatives = [entry(t, lp) for t, lp in top[at]] if top else []
        content.append(entry(token, logprob) | {"top_logprobs": alternatives})
    return {"content": content, "refusal": None}


def text_logprobs(
    tokens: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]] | None,
    text: TokenText,
) -> dict[str, Any]:
    """A text choice's ``logprobs`` (the legacy shape): tokens, their logprobs, each one's
    top alternatives as {text: logprob} (asked for), and each token's offset in the text."""
    pieces = [text(t) for t in tokens]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {
        "tokens": pieces,
        "token_logprobs": list(logprobs),
        "top_logprobs": [{text(t): lp for t, lp in alts} for alts in top] if top else None,
        "text_offset": offsets,
    }


def cut_at_stop(text: str, stops: str | list[str] | None) -> str:
    """The text before the first stop string (OpenAI leaves the stop sequence out)."""
    if not stops:
        return text
    listed = [stops] if isinstance(stops, str) else stops
    found = [at for s in listed if (at := text.find(s)) >= 0]
    return text[: min(found)] if found else text
