"""Per-job environment statistics (``env_stats.summarize_episodes``), checked by hand."""

from __future__ import annotations

import pytest

from opentinker.services.common.env_stats import (
    TruncationWatch,
    summarize_episodes,
    truncated_fraction,
)

pytestmark = pytest.mark.unit


def test_a_game_batch() -> None:
    stats = summarize_episodes(
        rewards=[1.0, -1.0, 0.0, 1.0, -0.1],
        turns=[7, 12, 41, 5, 3],
        outcomes=["win", "loss", "draw", "win", "loss"],
    )
    assert stats == pytest.approx(
        {
            "env_episodes": 5.0,
            "env_reward_sum": 0.9,  # 1 - 1 + 0 + 1 - 0.1
            "env_reward_mean": 0.18,  # 0.9 / 5
            "env_turns_mean": 13.6,  # (7 + 12 + 41 + 5 + 3) = 68; 68 / 5
            "env_win_rate": 0.4,  # 2 of 5
            "env_loss_rate": 0.4,  # 2 of 5
            "env_draw_rate": 0.2,  # 1 of 5
        }
    )


def test_no_outcomes_no_rates() -> None:
    stats = summarize_episodes(rewards=[1.0, 0.0, 0.0, 1.0], turns=[1, 1, 2, 4], outcomes=[])
    assert stats == pytest.approx(
        {
            "env_episodes": 4.0,
            "env_reward_sum": 2.0,
            "env_reward_mean": 0.5,  # 2 / 4
            "env_turns_mean": 2.0,  # 8 / 4
        }
    )


def test_rates_count_only_episodes_with_a_game_outcome() -> None:
    # The first episode ended without an outcome (e.g. it failed): the rates are over 3.
    stats = summarize_episodes(
        rewards=[0.0, 1.0, 1.0, -1.0], turns=[2, 3, 3, 4], outcomes=["", "win", "win", "loss"]
    )
    assert stats["env_win_rate"] == pytest.approx(2 / 3)
    assert stats["env_loss_rate"] == pytest.approx(1 / 3)
    assert stats["env_draw_rate"] == 0.0
    assert stats["env_episodes"] == 4.0 and stats["env_reward_mean"] == pytest.approx(0.25)
    # Outcomes that are not win/loss/draw (a math env's) give no rates.
    assert "env_win_rate" not in summarize_episodes([1.0], [1], ["ongoing"])


def test_no_episodes() -> None:
    assert summarize_episodes([], [], []) == {"env_episodes": 0.0, "env_reward_sum": 0.0}


@pytest.mark.parametrize(
    ("rewards", "turns", "outcomes", "words"),
    [
        ([1.0, 0.0], [1], [], "2 rewards, 1 turns"),
        ([1.0], [1], ["win", "loss"], "2 outcomes"),
        ([float("nan")], [1], [], "finite"),
    ],
)
def test_mismatched_or_bad_inputs_are_refused(
    rewards: list[float], turns: list[int], outcomes: list[str], words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        summarize_episodes(rewards, turns, outcomes)


def test_truncated_fraction_counts_episodes_a_budget_ended() -> None:
    # 3 of 4 episodes ended by a budget: 3 / 4 = 0.75
    assert truncated_fraction(["max_turns", "max_tokens", "", "max_turns"]) == 0.75
    assert truncated_fraction([]) == 0.0


def test_a_job_of_cut_short_episodes_is_warned_once() -> None:
    watch = TruncationWatch()
    assert watch.warning(1, ["max_turns"] * 8 + [""] * 2) is None  # 8 / 10 = 0.8 < 0.9
    message = watch.warning(2, ["max_turns"] * 9 + ["max_tokens"])  # 10 / 10 = 1.0
    assert message is not None
    assert "100%" in message and "9 at max_turns, 1 at max_episode_tokens" in message
    assert watch.warning(3, ["max_turns"] * 10) is None  # once per job
