"""The built-in ``letter`` environment: determinism by seed, the reward rule, option checks."""

from __future__ import annotations

import pytest

from opentinker.game import first_user_message
from opentinker.services.envhub.games.letter_env import LetterGame

pytestmark = pytest.mark.unit


def target_for(seed: int, num_letters: str = "8") -> str:
    game = LetterGame()
    game.reset(seed=seed, num_letters=num_letters)
    return game.target


def test_same_seed_gives_same_letter_and_seeds_spread_over_the_first_letters() -> None:
    assert [target_for(s) for s in range(50)] == [target_for(s) for s in range(50)]
    letters = {target_for(s) for s in range(200)}
    assert letters == set("ABCDEFGH")  # 200 draws over 8 letters hit every one of them


def test_num_letters_bounds_the_choice() -> None:
    assert {target_for(s, "1") for s in range(20)} == {"A"}
    assert {target_for(s, "26") for s in range(400)} == set("ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def test_target_option_fixes_the_letter_whatever_the_seed() -> None:
    game = LetterGame()
    targets = set()
    for seed in range(20):
        game.reset(seed=seed, num_letters="4", target="C")
        targets.add(game.target)
    assert targets == {"C"}
    for bad in ("E", "c", "AB"):  # outside A..D, lower case, two letters
        with pytest.raises(ValueError, match="target must be one of the 4 letters in play"):
            game.reset(seed=0, num_letters="4", target=bad)


def test_generate_initial_state_is_the_reset_target() -> None:
    game = LetterGame()
    game.reset(seed=7, num_letters="5")
    assert game.generate_initial_state(7, num_letters="5") == game.target


def test_prompt_names_the_letter() -> None:
    game = LetterGame()
    observation = game.reset(seed=3)
    assert observation == f"Answer with the letter {game.target}."
    assert first_user_message(game.get_initial_user_message(), observation) == observation
    assert "single capital letter" in game.get_system_prompt()


@pytest.mark.parametrize(
    ("answer", "reward"),
    [
        ("{t}", 1.0),
        ("  {t}\n", 1.0),  # whitespace around is stripped
        ("{t}, of course", 1.0),  # starts with the letter
        ("{lower}", 0.0),  # case-sensitive
        ("", 0.0),
        ("The letter {t}", 0.0),
        ("Z{t}", 0.0),
    ],
)
def test_reward(answer: str, reward: float) -> None:
    game = LetterGame()
    game.reset(seed=11, num_letters="8")  # seed 11 must not pick Z for the last case
    assert game.target != "Z"
    result = game.step(answer.format(t=game.target, lower=game.target.lower()))
    assert result.reward == reward
    assert result.done is True
    assert result.info == {"target": game.target, "outcome": "win" if reward else "loss"}


@pytest.mark.parametrize(
    ("answer", "reward"),
    [("{t}", 1.0), ("{other}", 0.1), ("Z", 0.0), ("x", 0.0), ("", 0.0)],
)
def test_format_reward_pays_for_another_letter_in_play(answer: str, reward: float) -> None:
    game = LetterGame()
    game.reset(seed=11, num_letters="8", format_reward="0.1")
    other = "A" if game.target != "A" else "B"  # in play (A..H) but not the named one
    assert game.step(answer.format(t=game.target, other=other)).reward == reward


@pytest.mark.parametrize("bad", ["-0.1", "1.5", "lots"])
def test_bad_format_reward_is_refused_naming_the_option(bad: str) -> None:
    with pytest.raises(ValueError, match="format_reward must be a number in"):
        LetterGame().reset(seed=0, format_reward=bad)


@pytest.mark.parametrize("bad", ["0", "27", "eight", ""])
def test_bad_num_letters_is_refused_naming_the_option(bad: str) -> None:
    with pytest.raises(ValueError, match="num_letters must be an integer 1..26"):
        LetterGame().reset(seed=0, num_letters=bad)


def test_spec_attributes() -> None:
    assert LetterGame.name == "letter"
    assert LetterGame.max_turns == 1
