"""A ``verifiers`` environment (classic API: SingleTurnEnv, MultiTurnEnv, ToolEnv) as an
OpenTinker environment: one ``VerifiersGame`` per episode, driving one verifiers rollout.

- Reset: the row ``seed % len(dataset)`` of the env's dataset (``split=eval``: its eval
  dataset) is formatted by verifiers (its system prompt, few-shot, question -> ``prompt``);
  the prompt's system messages become our system prompt, the rest the first user message.
- Step: the text is the model's reply (a ToolEnv's ``<tool_call>`` blocks become its tool
  calls); verifiers runs its stop conditions and ``env_response``, whose messages are the next
  observation (tool results as ``<tool_response>`` blocks).
- Done: verifiers' stop conditions said so; the reward is its rubric's score of the whole
  rollout (earlier steps give 0), its metrics and stop condition go to ``info``.
- A rollout that fails inside verifiers (``state["error"]``), a missing or non-numeric score,
  or a turn that takes longer than ``timeout_s``: an ``EnvironmentError_`` naming the env and
  what went wrong (INTERNAL); bad options (an unknown split, an empty dataset):
  ``InvalidArgumentError``.
"""

from __future__ import annotations

import importlib
import json
import math
import queue
from dataclasses import dataclass
from typing import Any

import verifiers as vf

from opentinker.errors import EnvironmentError_, InvalidArgumentError
from opentinker.game import AbstractGame, StepResult, Tool
from opentinker.services.envhub.adapters.serve_args import ADAPTER_TIMEOUT_S
from opentinker.services.envhub.adapters.verifiers_bridge import (
    DoneEvent,
    FailedEvent,
    PromptEvent,
    VerifiersRollout,
)

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class VerifiersSource:
    """The verifiers env one adapter serves. name: what we register; timeout_s: per turn."""

    env: vf.Environment
    name: str
    timeout_s: float = ADAPTER_TIMEOUT_S


def load_environment(spec: str, env_args: dict[str, Any] | None = None) -> vf.Environment:
    """``module:function`` (or a module with ``load_environment``) -> its verifiers env."""
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidArgumentError(f"--env {spec!r}: cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, function_name or "load_environment", None)
    if not callable(factory):
        raise InvalidArgumentError(
            f"--env {spec!r}: {module_name} has no function {function_name or 'load_environment'!r}"
        )
    env = factory(**(env_args or {}))
    if not isinstance(env, vf.Environment):
        raise InvalidArgumentError(
            f"--env {spec!r} returned {type(env).__name__}, not a verifiers Environment"
        )
    return env


class VerifiersGame(AbstractGame):
    """One verifiers rollout, turn by turn."""

    description = "a verifiers environment, through the verifiers adapter"

    def __init__(self, source: VerifiersSource) -> None:
        self._source = source
        self._rollout: VerifiersRollout | None = None
        self._system_prompt = source.env.system_prompt or ""
        self._finished = False

    # AbstractGame declares these as ClassVars; here they are per env, from the instance.
    @property
    def name(self) -> str:  # type: ignore[override]
        return self._source.name

    @property
    def max_turns(self) -> int:  # type: ignore[override]
        return max(0, int(getattr(self._source.env, "max_turns", 0) or 0))

    @property
    def tools(self) -> tuple[Tool, ...]:  # type: ignore[override]
        return tuple(
            Tool(name=t.name, description=t.description or "", parameters=dict(t.parameters))
            for t in self._source.env.tool_defs or ()
        )

    def get_system_prompt(self) -> str:
        return self._system_prompt

    def reset(self, *, seed: int = 0, split: str = "train") -> str:
        row = self._row(seed, split)
        self._rollout = VerifiersRollout(self._source.env, row)
        event = self._next_event("its first prompt")
        if not isinstance(event, PromptEvent):
            raise self._failed("the rollout ended before asking the model anything")
        system = [m for m in event.messages if _field(m, "role") == "system"]
        self._system_prompt = "\n\n".join(_content_text(m) for m in system)
        return render_messages([m for m in event.messages if _field(m, "role") != "system"])

    def step(self, action: str) -> StepResult:
        if self._rollout is None:
            raise EnvironmentError_("step before reset", reason="NOT_RESET")
        self._rollout.reply(action)
        event = self._next_event("its next turn")
        if isinstance(event, PromptEvent):
            return StepResult(
                observation=render_messages(_after_last_reply(event.messages)),
                reward=0.0,
                done=False,
            )
        self._finished = True
        return self._scored(event.output)

    def close(self) -> None:
        if self._rollout is not None and not self._finished:
            self._rollout.cancel()

    def _row(self, seed: int, split: str) -> dict[str, Any]:
        if split not in SPLITS:
            raise InvalidArgumentError(f"env option split must be one of {SPLITS}, got {split!r}")
        env = self._source.env
        try:
            dataset = env.get_dataset() if split == "train" else env.get_eval_dataset()
        except ValueError as exc:
            raise InvalidArgumentError(
                f"verifiers env '{self.name}' has no {split} dataset: {exc}"
            ) from exc
        if len(dataset) == 0:
            raise InvalidArgumentError(f"verifiers env '{self.name}' has an empty {split} dataset")
        return dict(dataset[seed % len(dataset)])

    def _next_event(self, what: str) -> PromptEvent | DoneEvent:
        assert self._rollout is not None
        try:
            event = self._rollout.next_event(self._source.timeout_s)
        except queue.Empty:
            raise self._failed(
                f"no answer for {what} within {self._source.timeout_s:g} s"
            ) from None
        if isinstance(event, FailedEvent):
            raise self._failed(f"{type(event.error).__name__}: {event.error}")
        return event

    def _scored(self, output: dict[str, Any]) -> StepResult:
        if output.get("error"):
            raise self._failed(f"the rollout stopped on an error: {output['error']}")
        reward = output.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise self._failed(f"its rubric gave reward {reward!r}, not a number")
        if not math.isfinite(reward):
            raise self._failed(f"its rubric gave a non-finite reward ({reward})")
        info = {f"metric_{k}": _text(v) for k, v in (output.get("metrics") or {}).items()}
        info["stop_condition"] = str(output.get("stop_condition") or "")
        completion = output.get("completion") or []
        final = _after_last_reply(completion) if isinstance(completion, list) else []
        return StepResult(
            observation=render_messages(final), reward=float(reward), done=True, info=info
        )

    def _failed(self, problem: str) -> EnvironmentError_:
        return EnvironmentError_(
            f"verifiers env '{self.name}' failed: {problem}", reason="VERIFIERS_FAILED"
        )


def render_messages(messages: list[Any]) -> str:
    """Chat messages as one user turn's text: user text as it is, tool results in
    ``<tool_response>`` blocks, anything else prefixed with its role."""
    parts = []
    for message in messages:
        role, text = _field(message, "role"), _content_text(message)
        if role == "tool":
            parts.append(f"<tool_response>\n{text}\n</tool_response>")
        elif role == "user":
            parts.append(text)
        else:
            parts.append(f"{role}: {text}")
    return "\n\n".join(parts)


def _after_last_reply(messages: list[Any]) -> list[Any]:
    """The messages after the last assistant message (the env's answer to it)."""
    for index in range(len(messages) - 1, -1, -1):
        if _field(messages[index], "role") == "assistant":
            return messages[index + 1 :]
    return messages


def _field(message: Any, name: str) -> Any:
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None)


def _content_text(message: Any) -> str:
    content = _field(message, "content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:  # a list of content parts
        kind = _field(part, "type")
        texts.append(str(_field(part, "text") or "") if kind == "text" else f"[{kind}]")
    return "".join(texts)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)
