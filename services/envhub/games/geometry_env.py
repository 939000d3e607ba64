"""``geometry`` and ``geometry_tools``: questions about a drawn figure (a vision-language env).

Each episode shows one figure (``geometry_figures``: a rectangle, square or right triangle with
its lengths written on it) as an image, with a question whose answer is an integer. The final
answer goes in ``\\boxed{}``: reward 1.0 when it equals the answer, else 0.0 — or, with the
reset option ``number_reward`` (0-1, default 0), that much partial credit for a last reply that
holds any number at all (a shaping signal for models that cannot answer yet).

- ``geometry``: single-turn; the first reply is graded.
- ``geometry_tools``: multi-turn with a ``calculator`` tool
  (``<tool_call>{"name": "calculator", "arguments": {"expression": "6*8/2"}}</tool_call>``):
  a reply with calls gets their results as the next observation; a reply with a boxed answer
  (outside calls) ends the episode; a turn that reaches the limit (reset option ``max_turns``,
  1-10, default 3) without one ends it with reward 0.0.
"""

from __future__ import annotations

import re
from typing import ClassVar

from opentinker.game import AbstractGame, Image, StepResult
from opentinker.services.envhub.games.calculator import (
    CALCULATOR_TOOL,
    boxed_answer,
    calculator_replies,
)
from opentinker.services.envhub.games.geometry_figures import GeometryProblem, geometry_problem

_NUMBER = re.compile(r"\d")


class GeometryGame(AbstractGame):
    """Single-turn: answer a question about the figure in ``\\boxed{}``."""

    name = "geometry"
    description = "Questions about a drawn figure (an image); answer in \\boxed{}."
    max_turns: ClassVar[int] = 1
    uses_images = True

    def get_system_prompt(self) -> str:
        return "Look at the figure and answer the question. Put the final number in \\boxed{}."

    def get_initial_images(self) -> tuple[Image, ...]:
        return (Image(self.problem.png, "image/png"),)

    def reset(self, *, seed: int = 0, number_reward: str = "0", **options: str) -> str:
        self.number_reward = float(number_reward)
        if not 0.0 <= self.number_reward <= 1.0:
            raise ValueError(f"number_reward must be 0-1, got {number_reward}")
        self.turn_limit = self._turn_limit(options)
        self.turns = 0
        self.problem: GeometryProblem = geometry_problem(seed)
        return self.problem.question

    def _turn_limit(self, options: dict[str, str]) -> int:
        if options:
            raise TypeError(f"unknown options {sorted(options)}; {self.name} takes number_reward")
        return 1

    def step(self, action: str) -> StepResult:
        self.turns += 1
        answer = boxed_answer(action)
        if answer is not None or self.turns >= self.turn_limit:
            correct = answer is not None and abs(answer - self.problem.answer) < 1e-6
            info = {"answer": str(self.problem.answer), "kind": self.problem.kind}
            info["ended_by"] = "answer" if answer is not None else "turn_limit"
            partial = self.number_reward if _NUMBER.search(action) else 0.0
            reward = 1.0 if correct else partial
            return StepResult(observation="", reward=reward, done=True, info=info)
        return StepResult(observation=self._tool_results(action), reward=0.0, done=False)

    def _tool_results(self, action: str) -> str:
        return "Give your final answer in \\boxed{}."


class GeometryToolsGame(GeometryGame):
    """Multi-turn with a calculator tool."""

    name = "geometry_tools"
    description = "Questions about a drawn figure, with a calculator tool; answer in \\boxed{}."
    max_turns: ClassVar[int] = 3
    tools = (CALCULATOR_TOOL,)

    def get_system_prompt(self) -> str:
        return (
            "Look at the figure and answer the question. You may call the calculator tool. "
            "Put the final number in \\boxed{}."
        )

    def _turn_limit(self, options: dict[str, str]) -> int:
        unknown = sorted(set(options) - {"max_turns"})
        if unknown:
            raise TypeError(
                f"unknown options {unknown}; {self.name} takes max_turns, number_reward"
            )
        limit = int(options.get("max_turns", self.max_turns))
        if not 1 <= limit <= 10:
            raise ValueError(f"max_turns must be 1-10, got {limit}")
        return limit

    def _tool_results(self, action: str) -> str:
        return calculator_replies(action)
