"""The arithmetic task's easier rungs (options ``ops`` and ``max_number``): only the kinds of
step asked for, every number under the cap, a validation split of their own, the default stream
unchanged, and bad values refused naming the option."""

from __future__ import annotations

import re

import pytest

from opentinker.services.envhub.games.arithmetic_env import ArithmeticGame


def test_a_rung_draws_only_its_kinds_of_step_and_numbers_under_its_cap() -> None:
    game = ArithmeticGame()
    for seed in range(60):
        text = game.reset(seed=seed, steps="1", ops="find,give", max_number="9")
        numbers = [int(n) for n in re.findall(r"\d+", text)]
        assert all(n <= 9 for n in numbers), text
        assert "find" in text or "give" in text, text
        assert not re.search(r"boxes|bags|doubled", text), text
        start, amount = numbers
        assert game.problem.answer == (start + amount if "find" in text else start - amount)


def test_a_rung_has_a_validation_split_of_its_own_and_the_default_is_unchanged() -> None:
    game = ArithmeticGame()
    easy = {game.generate_initial_state(s, split="validation", ops="find", max_number="9")
            for s in range(256)}  # fmt: skip
    default = {game.generate_initial_state(s, split="validation") for s in range(256)}
    assert not easy & default
    train = {game.generate_initial_state(s, ops="find", max_number="9") for s in range(100)}
    assert not easy & train
    # The default stream is what it was before rungs existed (pinned from before them).
    assert game.reset(seed=3).startswith("Dev has 26 shells. Then they buy 5 boxes with 11")
    assert game.problem.answer == 189
    assert game.generate_initial_state(3) == game.generate_initial_state(3, ops="", max_number="0")


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"ops": "split,double"}, "ops"),
        ({"ops": "find,teleport"}, "ops"),
        ({"max_number": "1"}, "max_number"),
        ({"max_number": "lots"}, "max_number"),
    ],
)
def test_bad_rung_options_are_refused_naming_the_option(options: dict, named: str) -> None:
    with pytest.raises(ValueError, match=f"env option {named} must"):
        ArithmeticGame().reset(seed=0, **options)
