"""tinker-cookbook's DPO recipe (``recipes/preference/dpo/train.py``, its ``cli_main`` on
the ``hhh`` dataset), unchanged, against the gateway in front of a real mesh, offline:
Anthropic/hh-rlhf is answered from local JSON rows in its own format.

The recipe's reference model is ``save_weights_and_get_sampling_client()`` of the initial
weights; its DPO loss starts at ln 2 (policy == reference) and must move away from it once
the policy has stepped. A sampler that followed the newest weights instead of staying the
snapshot it was made from would give ln 2 at every step (issue 33)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from cookbook_offline import close_after_each, json_splits, metrics, offline_recipes, write_jsonl
from tinker_cookbook.recipes.preference.dpo import train as dpo_train
from tinker_gateway_helpers import QWEN, gateway, mesh, monkeypatch_module

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["gateway", "mesh", "monkeypatch_module"]  # fixtures used here


def _hh_rows(n: int) -> list[dict]:
    """hh-rlhf rows: one exchange, the chosen answer B, the rejected one A."""
    prompt = "\n\nHuman: Answer with the letter B.\n\nAssistant:"
    return [{"chosen": f"{prompt} B", "rejected": f"{prompt} A A A"} for _ in range(n)]


@pytest.fixture(scope="module")
def offline_hh(gateway, mesh, letter_model_dir: Path, tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("hh")
    train = write_jsonl(root / "train.jsonl", _hh_rows(6))
    test = write_jsonl(root / "test.jsonl", _hh_rows(2))
    loaders = {"Anthropic/hh-rlhf": lambda *a, **k: json_splits(train=train, test=test)}
    with offline_recipes(mesh.api_key, letter_model_dir, monkeypatch_module, loaders) as close:
        yield close


_close_recipe_clients = close_after_each("offline_hh")


def test_dpo_recipe_runs_unchanged_and_its_loss_leaves_ln2(gateway, offline_hh, tmp_path) -> None:
    config = dpo_train.CLIConfig(
        model_name=QWEN,
        dataset="hhh",
        base_url=gateway,
        log_path=str(tmp_path / "dpo"),
        learning_rate=1e-2,
        batch_size=2,
        max_length=64,
        max_steps=3,
    )
    dpo_train.cli_main(config)
    rows = [row for row in metrics(tmp_path / "dpo") if "dpo_loss" in row]
    losses = [row["dpo_loss"] for row in rows]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), rows
    assert losses[0] == pytest.approx(math.log(2), abs=1e-3), losses  # policy == reference
    # the reference stayed the initial snapshot: the stepped policy's loss is not ln 2
    assert all(abs(x - math.log(2)) > 0.01 for x in losses[1:]), losses
    assert losses[-1] < losses[0], losses  # and it learned to prefer the chosen answer
