"""``arithmetic``: procedurally generated multi-step word problems, graded by value.

Each episode is a short story of 2 to 4 steps (option ``steps``: a fixed count instead) on one
quantity: someone starts with some items, buys boxes of them, gives some away, finds more,
splits them into equal bags and keeps one, doubles them. Every intermediate count is a whole,
non-negative number, so the answer is one integer. Easier rungs for small models: option
``ops`` keeps only some kinds of step (comma-separated among buy, give, find, split, double;
one of buy or find at least), ``max_number`` caps every number drawn (the start and each
amount; 0 = the usual ranges): ``steps=1, ops=find,give, max_number=9`` is one-digit addition
or subtraction, which SmolLM2-135M-Instruct answers about half the time (greedy).

The final answer is graded by value with math-verify (``math_grading.py``: the last
``\\boxed{}``, else the last number), so ``\\boxed{42}``, ``42.0`` and ``The answer is 42`` all
count and ``\\boxed{142}`` does not.

Splits (``generated_splits.py``): ``split=validation`` is a fixed set of 256 problems;
``train`` (the default) never gives one of them.

``arithmetic_tools``: the same problems, multi-turn, with the ``calculator`` tool
(``calculator.py``): a reply with calls gets their results; a reply with a ``\\boxed{}``
number outside the calls ends the episode, graded by value; reaching the turn limit (option
``max_turns``, 1-10, default 4) without one ends it with 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.games.calculator import (
    CALCULATOR_TOOL,
    boxed_answer,
    calculator_replies,
)
from opentinker.services.envhub.games.generated_splits import problem_for
from opentinker.services.envhub.games.math_grading import extracted_answer, is_equivalent

_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jonas")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards")


@dataclass(frozen=True)
class WordProblem:
    """The text of a problem and its answer (a whole number)."""

    text: str
    answer: int


KINDS = ("buy", "give", "find", "split", "double")


@dataclass(frozen=True)
class Rung:
    """How hard the stories are: the kinds of step used and the cap on every number drawn
    (0: none)."""

    ops: tuple[str, ...] = KINDS
    max_number: int = 0

    def draw(self, rng: random.Random, low: int, high: int) -> int:
        if not self.max_number:
            return rng.randint(low, high)
        return rng.randint(min(low, self.max_number), min(high, self.max_number))

    def suffix(self) -> str:
        """What names this rung's problem stream ('' for the default one)."""
        ops = "" if self.ops == KINDS else "-" + "+".join(self.ops)
        return ops + (f"-max{self.max_number}" if self.max_number else "")


def _step(rng: random.Random, count: int, items: str, rung: Rung) -> tuple[str, int]:
    """One more sentence of the story and the count after it."""
    while True:
        kind = rng.choice(rung.ops)
        if kind == "buy":
            boxes, each = rung.draw(rng, 2, 6), rung.draw(rng, 3, 12)
            return f"Then they buy {boxes} boxes with {each} {items} in each.", count + boxes * each
        if kind == "give" and count > 1:
            gone = rung.draw(rng, 1, count - 1)
            return f"They give {gone} {items} to a friend.", count - gone
        if kind == "find":
            found = rung.draw(rng, 1, 30)
            return f"Later they find {found} more {items}.", count + found
        if kind == "split":
            bags = [d for d in (2, 3, 4, 5) if count % d == 0 and count // d > 0]
            if bags:
                d = rng.choice(bags)
                return (
                    f"They share all their {items} equally among {d} bags and keep one bag.",
                    count // d,
                )
        if kind == "double" and count <= 200:
            return f"Their {items} are doubled by a gift of the same number.", count * 2


def make_problem(rng: random.Random, steps: int = 0, rung: Rung = Rung()) -> WordProblem:
    """A story of ``steps`` steps (0: 2 to 4, drawn)."""
    name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    count = rung.draw(rng, 5, 60)
    sentences = [f"{name} has {count} {items}."]
    for _ in range(steps or rng.randint(2, 4)):
        sentence, count = _step(rng, count, items, rung)
        sentences.append(sentence)
    sentences.append(f"How many {items} does {name} have now?")
    return WordProblem(" ".join(sentences), count)


class ArithmeticGame(AbstractGame):
    """One word problem per episode, one answer."""

    name = "arithmetic"
    description = "Multi-step arithmetic word problems, graded by value (math-verify)."
    max_turns = 1

    def __init__(self) -> None:
        self.problem = WordProblem("", 0)

    def get_system_prompt(self) -> str:
        return "Solve the problem step by step. Put your final answer in \\boxed{}."

    def generate_initial_state(self, seed: int, **options: str) -> WordProblem:
        steps = _steps_option(options.get("steps", "0"))
        rung = _rung(options.get("ops", ""), options.get("max_number", "0"))
        split = options.get("split") or "train"
        name = (self.name if not steps else f"{self.name}-{steps}") + rung.suffix()
        return problem_for(name, seed, split, lambda rng: make_problem(rng, steps, rung))

    def reset(
        self,
        *,
        seed: int = 0,
        split: str = "train",
        steps: str = "0",
        ops: str = "",
        max_number: str = "0",
    ) -> str:
        self.problem = self.generate_initial_state(
            seed, split=split, steps=steps, ops=ops, max_number=max_number
        )
        return self.problem.text

    def step(self, action: str) -> StepResult:
        correct = is_equivalent(action, str(self.problem.answer))
        info = {"answer": str(self.problem.answer), "extracted": extracted_answer(action)}
        return StepResult(observation="", reward=1.0 if correct else 0.0, done=True, info=info)


class ArithmeticToolsGame(ArithmeticGame):
    """The same problems, several turns, with a calculator."""

    name = "arithmetic_tools"
    description = "Multi-step word problems with a calculator tool; answer in \\boxed{}."
    max_turns = 4
    tools = (CALCULATOR_TOOL,)

    def __init__(self) -> None:
        super().__init__()
        self.turns, self.turn_limit = 0, self.max_turns

    def get_system_prompt(self) -> str:
        return (
            "Solve the problem step by step. You may call the calculator tool. "
            "Put your final answer in \\boxed{}."
        )

    def reset(  # type: ignore[override]  # one option more
        self,
        *,
        seed: int = 0,
        split: str = "train",
        steps: str = "0",
        ops: str = "",
        max_number: str = "0",
        max_turns: str = "4",
    ) -> str:
        self.turn_limit = int(max_turns) if max_turns.isdigit() else 0
        if not 1 <= self.turn_limit <= 10:
            raise ValueError(f"env option max_turns must be 1-10, got {max_turns!r}")
        self.turns = 0
        return super().reset(seed=seed, split=split, steps=steps, ops=ops, max_number=max_number)

    def step(self, action: str) -> StepResult:
        self.turns += 1
        answer = boxed_answer(action)
        if answer is None and self.turns < self.turn_limit:
            return StepResult(observation=calculator_replies(action), reward=0.0, done=False)
        correct = answer is not None and answer == self.problem.answer
        info = {
            "answer": str(self.problem.answer),
            "ended_by": "answer" if answer is not None else "turn_limit",
        }
        return StepResult(observation="", reward=1.0 if correct else 0.0, done=True, info=info)


def _steps_option(value: str) -> int:
    try:
        steps = int(value)
    except ValueError:
        steps = -1
    if not 0 <= steps <= 8:
        raise ValueError(f"env option steps must be 0 (2 to 4, drawn) or 1..8, got {value!r}")
    return steps


def _rung(ops: str, max_number: str) -> Rung:
    """The options ``ops`` and ``max_number`` as a Rung; ValueError naming the option."""
    kinds = tuple(k.strip() for k in ops.split(",") if k.strip()) or KINDS
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not {"buy", "find"} & set(kinds):
        raise ValueError(
            f"env option ops must name kinds among {', '.join(KINDS)}, one of buy or find at "
            f"least (the others cannot always apply), got {ops!r}"
        )
    cap = int(max_number) if max_number.isdigit() else -1
    if cap == 1 or not 0 <= cap <= 1_000_000:
        raise ValueError(
            f"env option max_number must be 0 (no cap) or 2..1000000, got {max_number!r}"
        )
    return Rung(tuple(k for k in KINDS if k in kinds), cap)
