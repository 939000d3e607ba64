"""The token record of one agent-program episode, built call by call without re-tokenizing.

Every chat completion extends a *segment*: the prompt ids and then, turn by turn, the
engine's own sampled ids (loss mask 1, their logprobs) and the ids of the messages the agent
added between calls (tool results, user messages: loss mask 0, logprob 0), rendered by the
chat template exactly as ``ChatFormat.observation_ids`` renders an observation.

A call continues the current segment when the conversation it sends starts with the
segment's conversation: every earlier message equal (role, text, tool calls) and every
assistant message exactly the reply the endpoint returned for it, so the ids of that reply
are the sampled ones, never the text re-tokenized. Otherwise (the agent rewrote, dropped or
invented a message, or changed its tools) the call starts a new segment from the whole
conversation rendered afresh, and ``rewrites`` counts it. Every segment trains: each becomes
a trajectory of its own with the episode's reward (episodes.py), so each model turn is
trained once, in the segment that sampled it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]  # one OpenAI chat message, as the agent sent it
_PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def canonical(message: Message) -> tuple:
    """What makes two messages the same turn: role, text, tool calls (name and arguments
    as parsed JSON) and the tool call a tool result answers. Ids the client may rebuild and
    fields it may drop or fill (``refusal``, ``None`` content) do not count."""
    calls = tuple(
        (c.get("function", {}).get("name", ""), _arguments(c.get("function", {}).get("arguments")))
        for c in message.get("tool_calls") or ()
    )
    return (message.get("role", ""), text_of(message.get("content")), calls)


def text_of(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def template_message(message: Message) -> Message:
    """A message as chat templates take it: text content, tool-call arguments as objects."""
    out: Message = {"role": message.get("role", "user"), "content": text_of(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": c.get("function", {}).get("name", ""),
                    "arguments": json.loads(_arguments(c.get("function", {}).get("arguments"))),
                },
            }
            for c in message["tool_calls"]
        ]
    for key in ("tool_call_id", "name"):
        if key in message:
            out[key] = message[key]
    return out


@dataclass
class Segment:
    """One token sequence: ``prompt_length`` prompt ids, then per completion token a logprob
    and a loss mask (1 = sampled by the engine). ``messages`` is the conversation the ids
    render, ending with the endpoint's last reply; ``turn_ends``: completion index after each
    model turn."""

    token_ids: list[int]
    prompt_length: int
    tools_key: str
    messages: list[tuple] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)

    def append(self, ids: Sequence[int], logprobs: Sequence[float], mask: int) -> None:
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.loss_mask.extend([mask] * len(ids))


class EpisodeRecord:
    """Every call of one episode: the segments, the calls and the rewrites."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token to close assistant turns with")
        self.tokenizer = tokenizer
        self.eos: int = tokenizer.eos_token_id
        self.segments: list[Segment] = []
        self.calls = 0
        self.rewrites = 0  # calls that could not continue the segment before them
        self._eos_in_probe = self._render(_PROBE, generation=False).count(self.eos)

    def prompt(self, messages: Sequence[Message], tools: Sequence[Message] | None) -> list[int]:
        """The ids to generate from for this call's conversation (continuing the current
        segment when it can, else opening a new one); the call's reply then goes to
        ``add_reply``."""
        tools_key = json.dumps(list(tools or ()), sort_keys=True)
        seen = self.segments[-1] if self.segments else None
        canon = [canonical(m) for m in messages]
        added = messages[len(seen.messages) :] if seen is not None else ()
        if (
            seen is not None
            and seen.tools_key == tools_key
            and canon[: len(seen.messages)] == seen.messages
            and added
            and all(m.get("role") != "assistant" for m in added)
        ):
            self._continue(seen, added)
        else:
            self.rewrites += seen is not None
            ids = self._render([template_message(m) for m in messages], True, list(tools or ()))
            self.segments.append(Segment(list(ids), len(ids), tools_key))
        self.segments[-1].messages = canon
        return list(self.segments[-1].token_ids)

    def add_reply(self, ids: Sequence[int], logprobs: Sequence[float], reply: Message) -> None:
        """Record the engine's sampled ids of this call and the reply the agent was sent."""
        segment = self.segments[-1]
        segment.append(ids, logprobs, mask=1)
        segment.turn_ends.append(len(segment.token_ids) - segment.prompt_length)
        segment.messages.append(canonical(reply))
        self.calls += 1

    def _continue(self, segment: Segment, added: Sequence[Message]) -> None:
        """Close the last reply with exactly one eos (the model's own when it stopped), then
        the added messages and the next generation prompt, as the template renders them
        after an assistant turn."""
        closing = [] if segment.token_ids[-1] == self.eos else [self.eos]
        rendered = self._render([*_PROBE, *(template_message(m) for m in added)], True)
        at = [i for i, t in enumerate(rendered) if t == self.eos]
        after = rendered[at[self._eos_in_probe - 1] + 1 :]
        ids = [*closing, *after]
        segment.append(ids, [0.0] * len(ids), mask=0)

    def _render(
        self, messages: list[Message], generation: bool, tools: list[Any] | None = None
    ) -> list[int]:
        return render(self.tokenizer, messages, generation, tools)


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    generation: bool,
    tools: Sequence[Any] | None = None,
) -> list[int]:
    """The ids of ``messages`` (as template_message makes them) by the chat template, with
    the assistant's generation prompt when ``generation``."""
    ids = tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=generation,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)
