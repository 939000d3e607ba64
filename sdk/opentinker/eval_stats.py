"""The statistics of an evaluation: accuracy with a 95% confidence interval, pass@k, and the
difference between two models on the same episodes. Pure (no torch), from inference rows.

Accuracy is the fraction of episodes with reward > 0; its interval is Wilson's score interval
(right near 0 and 1 and for small n, where the normal one leaves [0, 1]). The mean reward's
interval is the normal one. pass@k is the unbiased estimator of Chen et al. (2021),
``1 - C(n - c, k) / C(n, k)`` for a problem sampled n times with c right, averaged over the
problems sampled at least k times (episodes of one problem share their ``env_seed``). Two
runs with the same seed play the same env seeds, so their difference is paired: the interval
of the mean per-episode difference.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Z95 = 1.959963984540054


@dataclass(frozen=True)
class Interval:
    """A 95% confidence interval around ``value``."""

    value: float
    low: float
    high: float

    def describe(self, percent: bool = True) -> str:
        if percent:
            return f"{self.value:.1%} (95% CI {self.low:.1%}–{self.high:.1%})"
        return f"{self.value:.3f} (95% CI {self.low:.3f}–{self.high:.3f})"


def wilson(successes: int, n: int) -> Interval:
    """Wilson's score interval of a proportion."""
    if n == 0:
        return Interval(0.0, 0.0, 1.0)
    p = successes / n
    center = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    return Interval(p, max(0.0, center - half), min(1.0, center + half))


def mean_interval(values: Sequence[float]) -> Interval:
    """The mean and its normal-approximation interval (sample standard deviation)."""
    n = len(values)
    if n == 0:
        return Interval(0.0, 0.0, 0.0)
    mean = sum(values) / n
    if n == 1:
        return Interval(mean, mean, mean)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = Z95 * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half)


def pass_at_k(rows: Iterable[Mapping[str, Any]], k: int) -> float | None:
    """Mean unbiased pass@k over the problems (env seeds) played at least k times; None when
    none was."""
    by_problem: dict[int, list[bool]] = defaultdict(list)
    for row in rows:
        by_problem[row["env_seed"]].append(row["reward"] > 0)
    estimates = [
        1.0 - math.comb(len(tries) - sum(tries), k) / math.comb(len(tries), k)
        for tries in by_problem.values()
        if len(tries) >= k
    ]
    return sum(estimates) / len(estimates) if estimates else None


@dataclass(frozen=True)
class EvalResult:
    """One model on one env's episodes."""

    episodes: int
    accuracy: Interval
    mean_reward: Interval
    pass_at: dict[int, float]  # k -> pass@k, for the k that some problem was played k times

    def describe(self) -> str:
        passes = "".join(f", pass@{k} {v:.1%}" for k, v in sorted(self.pass_at.items()))
        return (
            f"accuracy {self.accuracy.describe()}, mean reward "
            f"{self.mean_reward.describe(percent=False)}{passes}, {self.episodes} episodes"
        )


def evaluate(rows: Sequence[Mapping[str, Any]], ks: Iterable[int] = (1,)) -> EvalResult:
    found = {k: pass_at_k(rows, k) for k in ks}
    return EvalResult(
        episodes=len(rows),
        accuracy=wilson(sum(r["reward"] > 0 for r in rows), len(rows)),
        mean_reward=mean_interval([float(r["reward"]) for r in rows]),
        pass_at={k: v for k, v in found.items() if v is not None},
    )


def paired_difference(
    before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]
) -> Interval:
    """after - before in accuracy over the episodes both played (matched by index and env
    seed): the mean per-episode difference and its interval."""
    earlier = {(r["index"], r["env_seed"]): r["reward"] > 0 for r in before}
    diffs = [
        float(r["reward"] > 0) - float(earlier[key])
        for r in after
        if (key := (r["index"], r["env_seed"])) in earlier
    ]
    return mean_interval(diffs)
