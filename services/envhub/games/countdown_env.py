"""``countdown``: reach a target with given numbers and + - * / (the TinyZero task).

Each episode draws 3 or 4 numbers in 1..99 and a target that some expression using every number
exactly once reaches (built from a random expression over them, so each problem is solvable).
The model answers with an expression inside ``<answer>…</answer>`` (or ``\\boxed{…}``); it is
graded by evaluating it exactly (fractions, so ``7 / 2 * 2`` is 7), never with ``eval``: only
numbers, the four operations and parentheses parse, and the numbers used must be the given ones,
each once. Reward 1.0 when it reaches the target; ``format_reward`` (default 0.0; TinyZero
used 0.1) for a well-formed expression that does not; 0.0 otherwise. ``info`` says which.

Splits (``generated_splits.py``): ``split=validation`` plays a fixed set of 256 problems;
``train`` (the default) draws from the seed and never gives a validation problem.
"""

from __future__ import annotations

import ast
import random
import re
from fractions import Fraction

from opentinker.game import AbstractGame, StepResult
from opentinker.services.envhub.games.generated_splits import problem_for

MAX_TARGET = 999
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ALLOWED = re.compile(r"[\d+\-*/().\s]+")
_OPS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__}

Problem = tuple[tuple[int, ...], int]  # (numbers, target)


def make_problem(rng: random.Random) -> Problem:
    """Numbers and a target that an expression using each number once reaches."""
    while True:
        numbers = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
        values = [Fraction(n) for n in rng.sample(numbers, len(numbers))]
        while len(values) > 1:  # combine two at random until one value is left
            b, a = values.pop(), values.pop()
            op = rng.choice("+-*/")
            if op == "/" and (b == 0 or (a / b).denominator != 1):
                op = "+"
            values.append({"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op])
        target = values[0]
        if target.denominator == 1 and 1 <= target <= MAX_TARGET:
            return tuple(numbers), int(target)


def extract_expression(response: str) -> str | None:
    """The last ``<answer>…</answer>`` (else the last ``\\boxed{…}``), stripped; None if none."""
    found = _ANSWER.findall(response) or _BOXED.findall(response)
    return found[-1].strip() if found else None


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """The exact value of an arithmetic expression and the numbers in it; ValueError naming
    what is wrong (a character, a construct, a division by zero)."""
    if not _ALLOWED.fullmatch(expression) or len(expression) > 200:
        raise ValueError("only numbers, + - * / and parentheses are allowed")
    try:
        tree = ast.parse(expression, mode="eval").body
    except SyntaxError as err:
        raise ValueError(f"not an expression: {err.msg}") from err
    numbers: list[int] = []
    return _value(tree, numbers), numbers


def _value(node: ast.expr, numbers: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        divisor = _value(node.right, numbers)
        left = _value(node.left, numbers)
        if divisor == 0:
            raise ValueError("division by zero")
        return left / divisor
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left, numbers), _value(node.right, numbers)
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"{type(node).__name__} is not allowed (numbers and + - * / only)")


def grade(response: str, numbers: tuple[int, ...], target: int) -> tuple[str, bool]:
    """(outcome, well_formed): outcome is correct, no_answer, bad_expression, wrong_numbers
    or wrong_value."""
    expression = extract_expression(response)
    if expression is None:
        return "no_answer", False
    try:
        value, used = evaluate(expression)
    except ValueError:
        return "bad_expression", False
    if sorted(used) != sorted(numbers):
        return "wrong_numbers", True
    return ("correct" if value == target else "wrong_value"), True


class CountdownGame(AbstractGame):
    """One problem per episode, one answer."""

    name = "countdown"
    description = "Reach the target with the given numbers, each once, and + - * /."
    max_turns = 1

    def __init__(self) -> None:
        self.numbers: tuple[int, ...] = ()
        self.target = 0
        self.format_reward = 0.0

    def get_system_prompt(self) -> str:
        return (
            "You solve arithmetic puzzles. Think step by step, then give your final expression "
            "inside <answer> </answer> tags, for example <answer>(1 + 2) * 3</answer>."
        )

    def generate_initial_state(self, seed: int, **options: str) -> Problem:
        return problem_for(self.name, seed, options.get("split") or "train", make_problem)

    def reset(self, *, seed: int = 0, split: str = "train", format_reward: str = "0") -> str:
        try:
            self.format_reward = float(format_reward)
        except ValueError:
            self.format_reward = -1.0  # refused below, naming the option
        if not 0.0 <= self.format_reward < 1.0:
            raise ValueError(f"env option format_reward must be in [0, 1), got {format_reward!r}")
        self.numbers, self.target = self.generate_initial_state(seed, split=split)
        listed = ", ".join(str(n) for n in self.numbers)
        return (
            f"Using the numbers [{listed}], create an equation that equals {self.target}. "
            "Use each number exactly once and only + - * /."
        )

    def step(self, action: str) -> StepResult:
        outcome, well_formed = grade(action, self.numbers, self.target)
        reward = 1.0 if outcome == "correct" else (self.format_reward if well_formed else 0.0)
        info = {"outcome": outcome, "target": str(self.target)}
        return StepResult(observation="", reward=reward, done=True, info=info)
