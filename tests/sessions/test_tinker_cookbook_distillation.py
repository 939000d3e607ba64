"""tinker-cookbook's on-policy distillation recipe
(``recipes/distillation/on_policy_distillation.py``, its ``cli_main`` on the ``deepmath``
prompts), unchanged, against the gateway in front of a real mesh, offline: zwhe99/DeepMath-103K
is answered from local rows, and the teacher is a base-model sampler of the same tiny model
(``teacher_model`` set to the mapped name, as a user picks a teacher). The per-token KL to
the teacher is the recipe's reward; the test checks it starts at 0 and grows once the
student has stepped."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import datasets
import pytest
from cookbook_offline import close_after_each, json_splits, metrics, offline_recipes, write_jsonl
from tinker_cookbook.distillation import datasets as distill_datasets
from tinker_cookbook.recipes.distillation import on_policy_distillation as distill
from tinker_gateway_helpers import QWEN, gateway, mesh, monkeypatch_module

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["gateway", "mesh", "monkeypatch_module"]  # fixtures used here


@pytest.fixture(scope="module")
def offline_deepmath(gateway, mesh, letter_model_dir: Path, tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("deepmath")
    rows = [{"question": f"What is {i} + {i}?"} for i in range(8)]
    train = write_jsonl(root / "train.jsonl", rows)

    def deepmath(*args, split: str = "train", **kwargs):
        if split != "train":
            raise ValueError(f"no {split!r} split here")  # the recipe then goes without a test set
        return json_splits(train=train)["train"]

    loaders = {"zwhe99/DeepMath-103K": deepmath}
    with offline_recipes(mesh.api_key, letter_model_dir, monkeypatch_module, loaders) as close:
        # the distillation datasets module took its own name for load_dataset at import
        monkeypatch_module.setattr(distill_datasets, "load_dataset", datasets.load_dataset)
        yield close


_close_recipe_clients = close_after_each("offline_deepmath")


def test_on_policy_distillation_runs_unchanged(gateway, offline_deepmath, tmp_path) -> None:
    config = distill.CLIConfig(
        base_url=gateway,
        log_path=str(tmp_path / "distill"),
        model_name=QWEN,
        teacher_model=QWEN,
        dataset="deepmath",
        lora_rank=4,
        group_size=2,
        groups_per_batch=2,
        max_tokens=6,
        learning_rate=5e-2,
        eval_every=0,
        save_every=0,
        max_steps=2,
    )
    asyncio.run(distill.cli_main(config))
    kls = [row["teacher_kl"] for row in metrics(tmp_path / "distill") if "teacher_kl" in row]
    assert len(kls) == 2 and all(math.isfinite(x) for x in kls), kls
    # the student starts as the teacher (same base): no KL; after one step it has moved off
    # the teacher, which stays the base model's sampler
    assert abs(kls[0]) < 1e-4 and kls[1] > 5e-4, kls
