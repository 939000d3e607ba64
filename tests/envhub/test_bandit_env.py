"""The built-in ``bandit`` environment: payouts follow the arms' probabilities, fixed by seed."""

from __future__ import annotations

import pytest

from opentinker.services.envhub.games.bandit_env import BanditGame

pytestmark = pytest.mark.unit


def reward(seed: int, answer: str, **options: str) -> float:
    game = BanditGame()
    game.reset(seed=seed, **options)
    return game.step(answer).reward


def test_each_arm_pays_at_its_probability() -> None:
    # Defaults 0.3, 0.8, 0.5, 0.1: over 2000 seeds the mean payout is within 0.04 of each
    # (3.5 standard deviations of a mean of 2000 draws at p = 0.5 is 0.039).
    for arm, probability in zip("ABCD", [0.3, 0.8, 0.5, 0.1], strict=True):
        mean = sum(reward(seed, arm) for seed in range(2000)) / 2000
        assert abs(mean - probability) < 0.04, (arm, mean)


def test_the_same_seed_and_answer_give_the_same_reward() -> None:
    assert [reward(s, "B") for s in range(100)] == [reward(s, "B") for s in range(100)]


def test_a_better_arm_pays_whenever_a_worse_one_does() -> None:
    # One draw per seed: an arm pays when its probability exceeds it (common random numbers).
    assert all(reward(s, "B") >= reward(s, "A") for s in range(500))


@pytest.mark.parametrize("answer", ["", "E", "b", "  ", "Z is best"])
def test_an_answer_naming_no_arm_earns_nothing(answer: str) -> None:
    game = BanditGame()
    game.reset(seed=0, arm_probabilities="1,1,1,1")
    result = game.step(answer)
    assert (result.reward, result.done, result.info["valid"]) == (0.0, True, "false")


def test_the_prompt_lists_the_arms_and_probabilities_are_an_option() -> None:
    game = BanditGame()
    assert game.reset(seed=0, arm_probabilities="0,1") == "Machines: A, B. Which one do you play?"
    assert game.step(" B, because...").reward == 1.0
    assert reward(0, "A", arm_probabilities="0,1") == 0.0


@pytest.mark.parametrize("bad", ["0.5", "0.1,1.5", "a,b", "", "nan,0.5"])
def test_bad_probabilities_are_refused_naming_the_option(bad: str) -> None:
    with pytest.raises(ValueError, match="arm_probabilities"):
        BanditGame().reset(seed=0, arm_probabilities=bad)
