"""Token ids of chat turns, built turn by turn from the tokenizer's chat template.

The template is the tokenizer's own, or the one the job chose (``ModelSpec.chat_template``,
put on the tokenizer when the engine loads it: ``modeling/template_choice.py``). A tokenizer
with neither is refused here, naming that field: a base model that ships no template (Gemma 3
270M base) runs with ``chat_template: "plain"``.

A transcript is never re-tokenized: the model's tokens stay exactly as sampled, and only the
new text of each turn (the env's observation) goes through the tokenizer, rendered by the
chat template so the ids are those the model would see in a whole rendered conversation.
The env's tools are rendered into the first prompt by the template itself (``tools=``), in
whatever form it teaches the model (Qwen2.5: a ``# Tools`` system section).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from opentinker.services.common.tool_calls import style_of
from opentinker.services.modeling.template_choice import NO_TEMPLATE_HINT
from opentinker.services.rollout.types import ToolSpec

_PROBE_USER = "u"
_PROBE_ASSISTANT = "a"


def template_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """An env's tools as transformers' chat templates take them (the OpenAI "function" shape)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters or {"type": "object", "properties": {}},
            },
        }
        for t in tools
    ]


class ChatFormat:
    """Prompt and observation-turn token ids for one tokenizer's chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: Sequence[ToolSpec] = ()) -> None:
        """tools: the env's tools, rendered into every prompt by the template (``tools=``)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the model's tokenizer has no chat template; {NO_TEMPLATE_HINT}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token to close assistant turns with")
        self.tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id
        self._tools = template_tools(tools)
        self.tool_call_style = style_of(getattr(tokenizer, "chat_template", None))
        closed = self._render(self._probe_conversation(), add_generation_prompt=False)
        if self.eos_token_id not in closed:
            raise ValueError(
                "the chat template does not close an assistant turn with the eos token "
                f"{tokenizer.eos_token!r}; multi-turn rollouts need it to"
            )
        # The assistant's eos is the last of the probe's: the n-th in any longer rendering
        self._eos_before_observation = closed.count(self.eos_token_id)

    def prompt_ids(self, system_prompt: str, observation: str) -> list[int]:
        """The first prompt: system (if any) and user message, then the assistant header.

        Rendering the chat template costs ~1 ms; a GRPO group's episodes share one prompt, so
        renders are cached by (system, observation) — a copy is returned, callers may append.
        """
        return list(self._cached_prompt_ids(system_prompt, observation))

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one ChatFormat per engine, lives as long
    def _cached_prompt_ids(self, system_prompt: str, observation: str) -> tuple[int, ...]:
        messages = [{"role": "user", "content": observation}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        return tuple(self._render(messages, add_generation_prompt=True, tools=self._tools))

    def renders_tools(self) -> bool:
        """True when the template shows the tools to the model (it renders ``tools=``)."""
        probe = [{"role": "user", "content": _PROBE_USER}]
        with_tools = self._render(probe, add_generation_prompt=True, tools=self._tools)
        return with_tools != self._render(probe, add_generation_prompt=True)

    def observation_ids(self, observation: str) -> list[int]:
        """Ids that follow an assistant turn's eos: the turn's end, a user turn, a new header.

        Taken from one rendering, after the assistant's eos: a template may render an
        assistant message differently when it is the last one (Qwen3's hybrid-thinking
        template adds an empty ``<think></think>`` only there), which is not in the
        transcript, whose assistant turns are the model's own tokens."""
        messages = [*self._probe_conversation(), {"role": "user", "content": observation}]
        full = self._render(messages, add_generation_prompt=True)
        at = [i for i, t in enumerate(full) if t == self.eos_token_id]
        if len(at) < self._eos_before_observation:
            raise ValueError("the chat template closes fewer turns with eos once a turn is added")
        return full[at[self._eos_before_observation - 1] + 1 :]

    @staticmethod
    def _probe_conversation() -> list[dict[str, str]]:
        return [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ASSISTANT},
        ]

    def _render(
        self,
        messages: list[dict[str, str]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        return list(ids)


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int], *, skip_special_tokens: bool) -> str:
    """One sequence of ids as text."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str), "decoding one sequence gives one string"
    return text
