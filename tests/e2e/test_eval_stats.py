"""The statistics `opentinker eval` reports, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from opentinker.eval_stats import evaluate, mean_interval, paired_difference, pass_at_k, wilson

pytestmark = pytest.mark.unit


def row(index: int, reward: float, env_seed: int | None = None) -> dict:
    return {"index": index, "env_seed": index if env_seed is None else env_seed, "reward": reward}


def test_wilson_interval_matches_the_textbook_values() -> None:
    # 8 of 10: p = 0.8; Wilson 95%: 0.4902 .. 0.9433 (Newcombe 1998, table I style)
    interval = wilson(8, 10)
    assert interval.value == 0.8
    assert interval.low == pytest.approx(0.4902, abs=1e-4)
    assert interval.high == pytest.approx(0.9433, abs=1e-4)
    zero = wilson(0, 20)  # stays inside [0, 1] where the normal interval would not
    assert zero.low == 0.0 and 0.0 < zero.high == pytest.approx(0.1611, abs=1e-4)
    assert wilson(0, 0).high == 1.0  # nothing known


def test_mean_interval_is_mean_plus_minus_1_96_standard_errors() -> None:
    values = [0.0, 1.0, 1.0, 0.5]
    mean, sd = 0.625, math.sqrt(sum((v - 0.625) ** 2 for v in values) / 3)
    interval = mean_interval(values)
    assert interval.value == mean
    assert interval.high - mean == pytest.approx(1.959964 * sd / 2)


def test_pass_at_k_is_the_unbiased_estimator_over_problems_tried_k_times() -> None:
    rows = [row(i, r, env_seed=7) for i, r in enumerate([1, 0, 0, 0])]  # n=4, c=1
    rows += [row(10 + i, 0, env_seed=9) for i in range(4)]  # n=4, c=0
    rows += [row(20, 1, env_seed=11)]  # tried once: counts for k=1 only
    # problem 7: pass@2 = 1 - C(3,2)/C(4,2) = 0.5; problem 9: 0
    assert pass_at_k(rows, 2) == pytest.approx(0.25)
    assert pass_at_k(rows, 1) == pytest.approx((0.25 + 0 + 1) / 3)
    assert pass_at_k(rows, 5) is None
    result = evaluate(rows, ks=(1, 2, 5))
    assert set(result.pass_at) == {1, 2} and result.episodes == 9
    assert "accuracy 22.2% (95% CI" in result.describe() and "pass@2 25.0%" in result.describe()


def test_a_paired_difference_matches_episodes_by_index_and_seed() -> None:
    before = [row(i, 0.0) for i in range(10)]
    after = [row(i, 1.0 if i < 4 else 0.0) for i in range(10)] + [row(99, 1.0)]  # unmatched
    diff = paired_difference(before, after)
    assert diff.value == pytest.approx(0.4)
    assert diff.low < 0.4 < diff.high
    same = paired_difference(before, before)
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0)
