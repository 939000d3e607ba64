"""Dataset-backed environments: reading rows from parquet/jsonl, splits, converting jsonl/csv
to parquet, and ``DatasetGame`` choosing rows by seed, split and index (also over gRPC)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from opentinker.data import Dataset, convert_to_parquet, read_records, write_jsonl, write_parquet
from opentinker.dataset_game import DatasetGame
from opentinker.env_server import serve
from opentinker.envhub.v1 import environment_pb2 as pb
from opentinker.envhub.v1 import environment_pb2_grpc
from opentinker.errors import ConfigError
from opentinker.game import StepResult

RECORDS = [
    {"prompt": f"capital of country {i}?", "ground_truth": f"city{i}", "split": split, "hint": i}
    for i, split in enumerate(["train"] * 8 + ["validation"] * 2)
]


class Capitals(DatasetGame):
    name = "capitals"
    max_turns = 1

    def get_system_prompt(self) -> str:
        return "Answer with a city."

    def step(self, action: str) -> StepResult:
        right = action.strip() == self.row.ground_truth
        return StepResult(observation="", reward=float(right), done=True)


@pytest.fixture(params=[".jsonl", ".parquet"])
def dataset_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    path = tmp_path / f"capitals{request.param}"
    (write_parquet if request.param == ".parquet" else write_jsonl)(RECORDS, path)
    return path


@pytest.mark.unit
def test_rows_are_read_by_split_with_their_extra_fields(dataset_file: Path) -> None:
    dataset = Dataset.load(dataset_file)
    assert dataset.splits == ["train", "validation"]
    assert len(dataset.rows("train")) == 8 and len(dataset) == 10
    row = dataset.rows("validation")[1]
    assert (row.prompt, row.ground_truth, row.split, row.index) == (
        "capital of country 9?",
        "city9",
        "validation",
        1,
    )
    assert row.extra == {"hint": 9}
    assert Dataset.load(dataset_file) is dataset  # read once, then cached


@pytest.mark.unit
def test_a_changed_file_is_read_again(tmp_path: Path) -> None:
    path = write_jsonl(RECORDS[:2], tmp_path / "d.jsonl")
    assert len(Dataset.load(path)) == 2
    write_jsonl(RECORDS[:3], path)
    assert len(Dataset.load(path)) == 3


@pytest.mark.unit
def test_rows_without_prompt_or_answer_are_refused_naming_the_row(tmp_path: Path) -> None:
    path = write_jsonl([RECORDS[0], {"prompt": "no answer"}], tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match="row 2: 'ground_truth' is missing"):
        Dataset.load(path)
    with pytest.raises(ConfigError, match="cannot be read"):
        Dataset.load(tmp_path / "missing.parquet")


@pytest.mark.unit
def test_the_game_picks_rows_by_seed_reproducibly(dataset_file: Path) -> None:
    def prompt(seed: int, **options: str) -> str:
        return Capitals(dataset=dataset_file).reset(seed=seed, **options)

    assert [prompt(s) for s in range(30)] == [prompt(s) for s in range(30)]
    train = {r["prompt"] for r in RECORDS if r["split"] == "train"}
    assert {prompt(s) for s in range(200)} == train  # every train row, and only those
    validation = {prompt(s, split="validation") for s in range(50)}
    assert validation == {"capital of country 8?", "capital of country 9?"}
    assert prompt(0, split="validation", index="1") == "capital of country 9?"


@pytest.mark.unit
def test_the_game_plays_its_row(dataset_file: Path) -> None:
    game = Capitals(dataset=dataset_file)
    game.reset(seed=1)
    assert game.step(f" {game.row.ground_truth}\n").reward == 1.0
    assert game.generate_initial_state(1) == game.row


@pytest.mark.unit
@pytest.mark.parametrize(
    ("options", "words"),
    [({"split": "test"}, "no split 'test'"), ({"index": "8"}, "index must be an integer 0..7")],
)
def test_bad_split_or_index_is_a_value_error(
    dataset_file: Path, options: dict[str, str], words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        Capitals(dataset=dataset_file).reset(seed=0, **options)


@pytest.mark.unit
def test_a_game_without_a_dataset_says_how_to_give_one() -> None:
    with pytest.raises(ConfigError, match="dataset_path"):
        Capitals()


@pytest.mark.unit
def test_jsonl_converts_to_parquet_with_renamed_fields_and_a_validation_split(
    tmp_path: Path,
) -> None:
    source = write_jsonl(
        [{"question": f"q{i}", "answer": i * 2, "level": "easy"} for i in range(200)],
        tmp_path / "raw.jsonl",
    )
    counts = convert_to_parquet(
        source,
        tmp_path / "out.parquet",
        prompt_field="question",
        answer_field="answer",
        validation_fraction=0.25,
        seed=1,
    )
    assert sum(counts.values()) == 200 and 30 < counts["validation"] < 70  # about 50
    rows = read_records(tmp_path / "out.parquet")
    assert rows[3] == {
        "prompt": "q3",
        "ground_truth": "6",
        "split": rows[3]["split"],
        "level": "easy",
    }
    again = convert_to_parquet(
        source,
        tmp_path / "again.parquet",
        prompt_field="question",
        answer_field="answer",
        validation_fraction=0.25,
        seed=1,
    )
    assert again == counts and read_records(tmp_path / "again.parquet") == rows  # stable


@pytest.mark.unit
def test_csv_converts_keeping_its_split_column(tmp_path: Path) -> None:
    source = tmp_path / "raw.csv"
    with source.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["prompt", "solution", "split", "source"])
        writer.writeheader()
        for i in range(6):
            writer.writerow(
                {
                    "prompt": f"p{i}",
                    "solution": f"s{i}",
                    "split": "train" if i < 4 else "test",
                    "source": "mine",
                }
            )
    counts = convert_to_parquet(source, tmp_path / "out.parquet", answer_field="solution")
    assert counts == {"train": 4, "test": 2}
    dataset = Dataset.load(tmp_path / "out.parquet")
    assert dataset.rows("test")[0].ground_truth == "s4"
    assert dataset.rows("test")[0].extra == {"source": "mine"}


@pytest.mark.unit
def test_conversion_names_a_missing_field_and_its_row(tmp_path: Path) -> None:
    source = write_jsonl(
        [{"question": "q", "answer": "a"}, {"question": "q2"}], tmp_path / "r.jsonl"
    )
    with pytest.raises(ConfigError, match=r"row 2 has no \['answer'\]"):
        convert_to_parquet(
            source, tmp_path / "o.parquet", prompt_field="question", answer_field="answer"
        )
    assert not (tmp_path / "o.parquet").exists()


@pytest.mark.unit
def test_unknown_formats_are_refused(tmp_path: Path) -> None:
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"use \.parquet, \.jsonl or \.csv"):
        read_records(tmp_path / "d.txt")


@pytest.mark.integration
def test_the_sdk_imports_without_pyarrow_and_jsonl_still_works(tmp_path: Path) -> None:
    path = write_jsonl(RECORDS, tmp_path / "d.jsonl")
    parquet = write_parquet(RECORDS, tmp_path / "d.parquet")
    code = f"""
import sys
sys.modules["pyarrow"] = None  # as if pyarrow were not installed
import opentinker.data, opentinker.dataset_game, opentinker.env_server
from opentinker.data import Dataset
from opentinker.errors import ConfigError
assert len(Dataset.load({str(path)!r})) == 10
try:
    Dataset.load({str(parquet)!r})
except ConfigError as err:
    assert "pyarrow" in str(err), err
else:
    raise AssertionError("a parquet file was read without pyarrow")
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.integration
def test_a_dataset_game_served_over_grpc(tmp_path: Path) -> None:
    path = write_parquet(RECORDS, tmp_path / "d.parquet")
    handle = serve(lambda: Capitals(dataset=path), block=False)
    try:
        with handle.channel() as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            reply = stub.Reset(
                pb.ResetRequest(
                    episode_id="e", seed=0, options={"split": "validation", "index": "0"}
                ),
                timeout=5,
            )
            assert reply.observation == "capital of country 8?"
            stepped = stub.Step(pb.StepRequest(episode_id="e", action="city8"), timeout=5)
            assert (stepped.reward, stepped.done) == (1.0, True)
            with pytest.raises(grpc.RpcError) as info:
                stub.Reset(pb.ResetRequest(episode_id="f", options={"split": "nope"}), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "capitals" in info.value.details() and "nope" in info.value.details()
    finally:
        handle.stop(grace_s=0)
