"""OpenAI chat-completions JSON in and out: the request an agent sends, the reply it gets
(whole, or as server-sent events when ``stream`` is true), and errors in OpenAI's shape.

Tool calls are read from the model's text in the hermes format (``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``, tool_calls.py) whenever the request offers tools, and sent
as OpenAI ``tool_calls`` with the rest of the text as ``content``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from opentinker.services.common.tool_calls import _HERMES_BLOCK, HERMES, parse_tool_calls

Message = dict[str, Any]


class ChatRequest(BaseModel):
    """The fields of a chat completion request the endpoint uses. Sampling fields
    (temperature, top_p, ...) are accepted and ignored: every call samples with the job's
    sampling, so the recorded logprobs are the policy's."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    messages: list[Message] = Field(..., min_length=1)
    tools: list[Message] | None = None
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1, description="one choice per call: each is a recorded turn")

    @property
    def token_cap(self) -> int | None:
        """The caller's cap on this reply's tokens, if any."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def tool_names(self) -> list[str]:
        return [t.get("function", {}).get("name", "") for t in self.tools or ()]


def reply_message(text: str, tool_names: list[str]) -> Message:
    """The assistant message of a reply: the text, and tool calls when tools were offered
    and the text holds well-formed calls to them."""
    message: Message = {"role": "assistant", "content": text}
    if not tool_names:
        return message
    parsed = parse_tool_calls(text, tool_names, HERMES)
    if not parsed.calls or parsed.errors:
        return message  # unparsable calls stay text: the agent sees what the model wrote
    message["content"] = _HERMES_BLOCK.sub("", text).strip() or None
    message["tool_calls"] = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in parsed.calls
    ]
    return message


def finish_reason(message: Message, stopped: bool) -> str:
    """'tool_calls', 'stop' (the model ended its turn) or 'length' (the token cap)."""
    if message.get("tool_calls"):
        return "tool_calls"
    return "stop" if stopped else "length"


def chat_choice(
    index: int, message: Message, finish: str, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}


def completion_body(
    model: str, message: Message, finish: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """A chat completion of one choice."""
    return chat_body(model, [chat_choice(0, message, finish)], prompt_tokens, completion_tokens)


def chat_body(
    model: str,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    completion_tokens: int,
    *,
    kind: str = "chat.completion",
) -> dict[str, Any]:
    """A completion's body: ``kind`` "chat.completion" (choices of chat_choice) or
    "text_completion" (choices with ``text``); usage counts tokens of all the choices."""
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def stream_events(body: dict[str, Any]) -> Iterator[str]:
    """A finished completion as the server-sent events of a streamed one, then ``[DONE]``:
    per chat choice its role, content (with its logprobs), each tool call and the finish
    reason; per text choice one chunk with its text."""
    head = {k: body[k] for k in ("id", "created", "model")}
    if body["object"] == "text_completion":
        for choice in body["choices"]:
            yield _event(head | {"object": "text_completion", "choices": [choice]})
        yield "data: [DONE]\n\n"
        return
    head |= {"object": "chat.completion.chunk"}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, **more: Any) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish, **more}
        return _event(head | {"choices": [choice]})

    for choice in body["choices"]:
        index, message = choice["index"], choice["message"]
        yield chunk(index, {"role": "assistant", "content": ""})
        if message.get("content"):
            yield chunk(index, {"content": message["content"]}, logprobs=choice.get("logprobs"))
        for at, call in enumerate(message.get("tool_calls") or ()):
            yield chunk(index, {"tool_calls": [{"index": at, **call}]})
        yield chunk(index, {}, choice["finish_reason"])
    yield "data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def error_body(message: str, kind: str, code: str, param: str | None = None) -> dict[str, Any]:
    """An error as OpenAI sends one (the openai client raises it with this message)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
