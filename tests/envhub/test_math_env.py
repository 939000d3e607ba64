"""The built-in ``math`` environment: grading by value (cases a substring check gets wrong),
the generated dataset, and episodes chosen by seed and split."""

from __future__ import annotations

from pathlib import Path

import pytest

from opentinker.data import Dataset
from opentinker.services.envhub.games.math_dataset import (
    PROBLEM_KINDS,
    default_math_dataset,
    generate_math_records,
    write_math_dataset,
)
from opentinker.services.envhub.games.math_env import MathGame
from opentinker.services.envhub.games.math_grading import extracted_answer, is_equivalent

pytestmark = pytest.mark.unit


def substring_grade(response: str, ground_truth: str) -> bool:
    """The naive grader these cases prove wrong."""
    return ground_truth in response


# (response, ground truth, the right grade); a substring check gets every one of them wrong.
SUBSTRING_GETS_WRONG = [
    (r"The answer is \boxed{15}.", "5", False),
    (r"So $x = \boxed{-3}$", "3", False),
    (r"I first thought 7, but it is \boxed{8}.", "7", False),
    (r"\boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{0.5}", r"\frac{1}{2}", True),
    (r"\boxed{\dfrac{2}{4}}", "1/2", True),
    (r"\boxed{1,000}", "1000", True),
    (r"\boxed{12}", r"12 \text{ cm}", True),
    (r"It travels \boxed{241.5\text{ km}}", r"\frac{483}{2}", True),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", True),
    (r"\boxed{-0.75}", r"-\frac{3}{4}", True),
    (r"\boxed{4.5}", "4.50", True),
]

# Cases a substring check happens to get right; the real grader must get them right too.
ALSO_RIGHT = [
    (r"\boxed{5\,\mathrm{kg}}", "5", True),
    (r"The answer is \boxed{\$12}", "12", True),
    ("5 apples", "5", True),
    ("no idea", "5", False),
    ("", "5", False),
]


@pytest.mark.parametrize(("response", "ground_truth", "right"), SUBSTRING_GETS_WRONG)
def test_grading_by_value_where_a_substring_check_fails(
    response: str, ground_truth: str, right: bool
) -> None:
    assert substring_grade(response, ground_truth) is not right  # the case is a real trap
    assert is_equivalent(response, ground_truth) is right


@pytest.mark.parametrize(("response", "ground_truth", "right"), ALSO_RIGHT)
def test_grading_plain_cases(response: str, ground_truth: str, right: bool) -> None:
    assert is_equivalent(response, ground_truth) is right


def test_an_unparsable_ground_truth_is_an_error_not_a_zero() -> None:
    with pytest.raises(ValueError, match="ground truth"):
        is_equivalent(r"\boxed{1}", "")


def test_every_generated_answer_grades_as_right_against_itself_boxed() -> None:
    for record in generate_math_records(60, seed=3):
        assert is_equivalent(f"\\boxed{{{record['ground_truth']}}}", record["ground_truth"])


def test_the_generated_dataset_is_reproducible_and_covers_every_kind() -> None:
    records = generate_math_records(120, seed=5)
    assert records == generate_math_records(120, seed=5)
    assert records != generate_math_records(120, seed=6)
    assert {r["kind"] for r in records} == set(PROBLEM_KINDS)
    splits = {r["split"] for r in records}
    assert splits == {"train", "validation"}
    share = sum(r["split"] == "validation" for r in records) / len(records)
    assert 0.05 < share < 0.4  # about 0.2


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_the_dataset_written_to_a_file_reads_back_the_same(tmp_path: Path, suffix: str) -> None:
    path = write_math_dataset(tmp_path / f"math{suffix}", count=30, seed=2)
    loaded = Dataset.load(path)
    expected = Dataset.from_records(generate_math_records(30, seed=2))
    assert len(loaded) == 30
    for split in expected.splits:
        assert loaded.rows(split) == expected.rows(split)


def test_an_episode_rewards_the_right_answer_only() -> None:
    game = MathGame()
    prompt = game.reset(seed=4)
    row = game.row
    assert prompt == row.prompt
    assert r"\boxed{}" in game.get_system_prompt()
    right = game.step(f"Working... so the answer is \\boxed{{{row.ground_truth}}}.")
    assert (right.reward, right.done, right.info["correct"]) == (1.0, True, "true")
    assert right.info["ground_truth"] == row.ground_truth
    game.reset(seed=4)
    wrong = game.step(r"\boxed{123456789}")
    assert (wrong.reward, wrong.info["correct"], wrong.info["answer"]) == (
        0.0,
        "false",
        "123456789",
    )


def test_episodes_are_chosen_by_seed_and_split() -> None:
    def prompt(seed: int, **options: str) -> str:
        return MathGame().reset(seed=seed, **options)

    assert [prompt(s) for s in range(20)] == [prompt(s) for s in range(20)]
    assert len({prompt(s) for s in range(20)}) > 10
    validation = {row.prompt for row in default_math_dataset().rows("validation")}
    assert all(prompt(s, split="validation") in validation for s in range(20))
    assert (
        prompt(0, split="validation", index="0")
        == default_math_dataset().rows("validation")[0].prompt
    )


def test_extracted_answer_is_the_last_boxed() -> None:
    assert extracted_answer(r"maybe \boxed{1}, no: \boxed{\frac{2}{3}}") == r"\frac{2}{3}"
    assert extracted_answer("nothing here") == ""


def test_only_the_last_boxed_answer_counts() -> None:
    assert is_equivalent(r"maybe \boxed{1}, no: \boxed{\frac{2}{3}}", r"\frac{2}{3}")
    assert not is_equivalent(r"maybe \boxed{1}, no: \boxed{\frac{2}{3}}", "1")
    assert not is_equivalent(r"\boxed{1, 2, 3}", "2")  # hedging with a list is wrong
