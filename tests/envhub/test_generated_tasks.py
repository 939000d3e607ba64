"""The generated reasoning tasks: Countdown (reach a target with + - * /) and multi-step
arithmetic word problems. Graders on hand-checked cases, every problem solvable and answered
right (checked by an independent solver), fixed validation splits disjoint from training."""

from __future__ import annotations

import itertools
import re
from fractions import Fraction

import pytest

from opentinker.services.envhub.games.arithmetic_env import ArithmeticGame
from opentinker.services.envhub.games.countdown_env import CountdownGame, grade

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("response", "outcome"),
    [
        ("<answer>3 * 5 + 7</answer>", "correct"),
        ("I think \\boxed{7 + 5 * 3}", "correct"),
        ("<answer>1</answer> no wait <answer>(3*5)+7</answer>", "correct"),  # the last one
        ("<answer>(7 - 5) * 3</answer>", "wrong_value"),
        ("<answer>3 * 5 + 8</answer>", "wrong_numbers"),
        ("<answer>3 * 5</answer>", "wrong_numbers"),  # every number, once
        ("<answer>3 * 5 + 7 + 7 - 7</answer>", "wrong_numbers"),
        ("<answer>__import__('os')</answer>", "bad_expression"),
        ("<answer>3 ** 5 + 7</answer>", "bad_expression"),
        ("<answer>7 / (5 - 5) + 3</answer>", "bad_expression"),
        ("<answer>3.0 * 5 + 7</answer>", "bad_expression"),
        ("<answer>3 * 5 + 7", "no_answer"),
        ("22", "no_answer"),
    ],
)
def test_countdown_grades_by_exact_value_and_the_numbers_used(response: str, outcome: str) -> None:
    assert grade(response, (3, 5, 7), 22)[0] == outcome


def test_countdown_divides_exactly() -> None:
    assert grade("<answer>7 / 2 * 2</answer>", (7, 2, 2), 7)[0] == "correct"
    assert grade("<answer>7 / 2 * 2</answer>", (7, 2, 2), 6)[0] == "wrong_value"


def _reachable(numbers: tuple[int, ...]) -> set[Fraction]:
    """Every value an expression using each number exactly once reaches (brute force)."""
    if len(numbers) == 1:
        return {Fraction(numbers[0])}
    out: set[Fraction] = set()
    for k in range(1, len(numbers)):
        for left in set(itertools.combinations(range(len(numbers)), k)):
            right = [numbers[i] for i in range(len(numbers)) if i not in left]
            for a in _reachable(tuple(numbers[i] for i in left)):
                for b in _reachable(tuple(right)):
                    out |= {a + b, a - b, a * b} | ({a / b} if b else set())
    return out


def test_every_countdown_problem_is_solvable_and_the_splits_are_fixed_and_apart() -> None:
    game = CountdownGame()
    train = set()
    for seed in range(40):
        game.reset(seed=seed)
        assert 3 <= len(game.numbers) <= 4 and 1 <= game.target <= 999
        assert Fraction(game.target) in _reachable(game.numbers)
        train.add((game.numbers, game.target))
    validation = {game.generate_initial_state(s, split="validation") for s in range(256)}
    assert len(validation) > 250 and not train & validation
    assert game.generate_initial_state(3, split="validation") == game.generate_initial_state(
        259, split="validation"
    )  # a fixed set of 256: the seed picks one
    game.reset(seed=7)
    again = CountdownGame()
    again.reset(seed=7)
    assert (again.numbers, again.target) == (game.numbers, game.target)
    with pytest.raises(ValueError, match="split must be 'train' or 'validation'"):
        game.reset(seed=1, split="test")


def test_countdown_rewards_and_its_format_reward() -> None:
    game = CountdownGame()
    game.reset(seed=0, format_reward="0.1")
    assert game.step("<answer>1 + 1</answer>").reward == pytest.approx(0.1)  # well formed
    assert game.step("no idea").reward == 0.0
    assert game.step("<answer>os.system('x')</answer>").info["outcome"] == "bad_expression"
    for bad in ("1.5", "lots"):
        with pytest.raises(ValueError, match="format_reward must be in"):
            game.reset(seed=0, format_reward=bad)


_START = re.compile(r"^\w+ has (\d+) (\w+)\.$")
_RULES = [
    (re.compile(r"buy (\d+) boxes with (\d+)"), lambda n, a, b: n + a * b),
    (re.compile(r"give (\d+) "), lambda n, a: n - a),
    (re.compile(r"find (\d+) more"), lambda n, a: n + a),
    (re.compile(r"equally among (\d+) bags"), lambda n, a: n // a),
    (re.compile(r"doubled"), lambda n: n * 2),
]


def _solve(text: str) -> int:
    """An independent reading of the story: each sentence's rule applied in turn."""
    sentences = [s.strip() + "." for s in text.split(".") if s.strip()]
    match = _START.match(sentences[0])
    assert match, sentences[0]
    count = int(match.group(1))
    for sentence in sentences[1:]:
        for pattern, rule in _RULES:
            if found := pattern.search(sentence):
                count = rule(count, *map(int, found.groups()))
                break
        else:
            raise AssertionError(f"no rule for {sentence!r}")
        assert count >= 0
    return count


def test_arithmetic_problems_have_the_answer_an_independent_reading_gives() -> None:
    game = ArithmeticGame()
    for seed in range(100):
        text = game.reset(seed=seed)
        assert text.endswith("have now?") and 3 <= text.count(".") <= 5
        assert _solve(text.rsplit("How many", 1)[0]) == game.problem.answer
    game.reset(seed=1, steps="6")
    assert game.problem.text.count(".") == 7
    with pytest.raises(ValueError, match="steps must be"):
        game.reset(seed=1, steps="many")


def test_arithmetic_grades_the_final_answer_by_value() -> None:
    game = ArithmeticGame()
    game.reset(seed=5)
    answer = game.problem.answer
    for right in (
        f"... so \\boxed{{{answer}}}",
        f"The answer is {answer}.",
        f"\\boxed{{{answer}.0}}",
    ):
        assert game.step(right).reward == 1.0, right
    for wrong in (f"\\boxed{{1{answer}}}", f"\\boxed{{{answer}}} no, \\boxed{{{answer + 1}}}", ""):
        assert game.step(wrong).reward == 0.0, wrong
    validation = {game.generate_initial_state(s, split="validation") for s in range(256)}
    train = {game.generate_initial_state(s) for s in range(200)}
    assert not validation & train


def test_arithmetic_with_a_calculator_answers_calls_then_grades_the_boxed_answer() -> None:
    from opentinker.services.envhub.games.arithmetic_env import ArithmeticToolsGame

    game = ArithmeticToolsGame()
    assert [t.name for t in game.tools] == ["calculator"]
    game.reset(seed=2, max_turns="3")
    answer = game.problem.answer
    call = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "17 + 3 * 7"}}</tool_call>'
    )
    first = game.step(call)
    assert not first.done and "17 + 3 * 7 = 38" in first.observation
    boxed = f"\\\\boxed{{{answer}}}"  # JSON-escaped
    inside = call.replace("17 + 3 * 7", boxed)
    assert not game.step(inside).done  # a boxed number inside a call is no answer
    last = game.step(f"So \\boxed{{{answer}}}")
    assert last.done and last.reward == 1.0 and last.info["ended_by"] == "answer"
    game.reset(seed=2, max_turns="1")
    ended = game.step("I am not sure")
    assert ended.done and ended.reward == 0.0 and ended.info["ended_by"] == "turn_limit"
    with pytest.raises(ValueError, match="max_turns must be 1-10"):
        game.reset(seed=2, max_turns="0")
