"""The statistics of an evaluation: accuracy with a 95% confidence interval, pass@k, and the
difference between two models on the same episodes. Pure (no torch), from inference rows.

Accuracy is the fraction of episodes with reward > 0; its interval is Wilson's score interval
(right near 0 and 1 and for small n, where the normal one leaves [0, 1]). The mean reward's
interval is the normal one. pass@k is the unbiased estimator of Chen et al. (2021),
``1 - C(n - c, k) / C(n, k)`` for a problem sampled n times with c right, averaged over the
problems sampled at least k times (episodes of one problem share their ``env_seed``; an eval
with ``samples_per_episode`` n plays every problem n times). With several samples of a problem
they are not independent draws, so the intervals are taken over problems instead (a
cluster-robust interval of the same mean; ``cluster_interval``). Two runs
with the same seed play the same env seeds, so their difference is paired: the interval of the
mean per-episode difference (sample j of a problem paired with sample j of the same problem).
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
    """One model on one env's episodes (``episodes`` rows of ``problems`` env seeds)."""

    episodes: int
    accuracy: Interval
    mean_reward: Interval
    pass_at: dict[int, float]  # k -> pass@k, for the k that some problem was played k times
    problems: int = 0

    def describe(self) -> str:
        passes = "".join(f", pass@{k} {v:.1%}" for k, v in sorted(self.pass_at.items()))
        played = f"{self.episodes} episodes"
        if self.problems and self.problems != self.episodes:
            played += f" ({self.problems} problems, {self.episodes / self.problems:g} samples each)"
        return (
            f"accuracy {self.accuracy.describe()}, mean reward "
            f"{self.mean_reward.describe(percent=False)}{passes}, {played}"
        )


def evaluate(rows: Sequence[Mapping[str, Any]], ks: Iterable[int] = (1,)) -> EvalResult:
    found = {k: pass_at_k(rows, k) for k in ks}
    by_problem: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        by_problem[row["env_seed"]].append(row)
    solved = [[float(r["reward"] > 0) for r in t] for t in by_problem.values()]
    rewards = [[float(r["reward"]) for r in t] for t in by_problem.values()]
    if len(by_problem) < 2 or all(len(tries) == 1 for tries in solved):
        accuracy = wilson(sum(r["reward"] > 0 for r in rows), len(rows))
        mean_reward = mean_interval([float(r["reward"]) for r in rows])
    else:  # samples of one problem are correlated: the interval is over problems
        accuracy = _clipped(cluster_interval(solved))
        mean_reward = cluster_interval(rewards)
    return EvalResult(
        episodes=len(rows),
        accuracy=accuracy,
        mean_reward=mean_reward,
        pass_at={k: v for k, v in found.items() if v is not None},
        problems=len(by_problem),
    )


def cluster_interval(groups: Sequence[Sequence[float]]) -> Interval:
    """The mean of all values and its interval when the values come in correlated groups
    (the samples of one problem): the cluster-robust standard error of a ratio mean,
    ``sqrt(G / (G - 1) * sum_g (y_g - mean * m_g)^2) / N`` over G groups of m_g values summing
    to y_g, N values in all. With equal group sizes this is the normal interval of the mean of
    the G group means."""
    n = sum(len(g) for g in groups)
    mean = sum(sum(g) for g in groups) / n
    spread = sum((sum(g) - mean * len(g)) ** 2 for g in groups)
    half = Z95 * math.sqrt(len(groups) / (len(groups) - 1) * spread) / n
    return Interval(mean, mean - half, mean + half)


def _clipped(interval: Interval) -> Interval:
    return Interval(interval.value, max(0.0, interval.low), min(1.0, interval.high))


def paired_difference(
    before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]
) -> Interval:
    """after - before in accuracy over the episodes both played (matched by index, env seed
    and sample number within the problem): the mean per-episode difference and its interval."""
    earlier = dict(_keyed(before))
    diffs = [float(right) - float(earlier[key]) for key, right in _keyed(after) if key in earlier]
    return mean_interval(diffs)


def _keyed(rows: Sequence[Mapping[str, Any]]) -> Iterable[tuple[tuple[int, int, int], bool]]:
    """(index, env seed, j) -> solved, for the j-th row of each (index, env seed)."""
    seen: dict[tuple[int, int], int] = defaultdict(int)
    for r in rows:
        problem = (r["index"], r["env_seed"])
        yield (*problem, seen[problem]), r["reward"] > 0
        seen[problem] += 1
