"""The vLLM multi-LoRA engine's CPU-testable parts: the adapter table (ids and folders per job
and version), the request of each row, the engine options, and which shared engine a node
picks. vLLM itself needs a GPU: tests/rollout/test_vllm_multi_lora_gpu.py runs it there.

Nothing of vLLM is faked here: these parts take no vLLM object (the folders are read back by
peft, the real reader of the format vLLM loads).
"""

from __future__ import annotations

import sys
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from opentinker.errors import ConfigError
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.engines.engine import WeightUpdateError
from opentinker.services.rollout.engines.engine_choice import shared_engine_loader
from opentinker.services.rollout.engines.multi_lora import LoraRow, SharedLoraEngine
from opentinker.services.rollout.engines.vllm_adapters import WeightShapes
from opentinker.services.rollout.engines.vllm_multi_lora import (
    AdapterTable,
    multi_lora_options,
    row_requests,
)
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.spec import LoraConfig, ModelSpec, SamplingParams

pytestmark = pytest.mark.integration

EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def spec_of(model_dir: Path, rank: int) -> ModelSpec:
    return ModelSpec(base_model=str(model_dir), finetune="lora", lora=LoraConfig(rank=rank))


def random_update(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(s, generator=generator) * 0.2
        for n, s in WeightShapes.of(spec).shapes.items()
    }


def folder_tensors(model_dir: Path, folder: Path) -> dict[str, torch.Tensor]:
    """The adapter a folder holds, as peft loads it (the trainer's names)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(folder))
    return {n: p.detach().clone() for n, p in loaded.named_parameters() if "lora_" in n}


@pytest.fixture
def table(model_dir: Path, tmp_path: Path) -> AdapterTable:
    return AdapterTable(
        tmp_path / "adapters", base_model=str(model_dir), capacity=2, max_lora_rank=8
    )


def test_each_job_gets_its_own_ids_and_an_update_touches_only_its_adapter(
    table: AdapterTable, model_dir: Path
) -> None:
    a_spec, b_spec = spec_of(model_dir, 4), spec_of(model_dir, 8)
    a0 = table.add("job_a", a_spec)
    table.commit("job_a", a0)
    b0 = table.add("job_b", b_spec)
    table.commit("job_b", b0)
    assert a0.lora_id != b0.lora_id and a0.name != b0.name
    assert table.adapters == ["job_a", "job_b"]
    # a fresh adapter is zeros (B = 0: the base model), in the trainer's names
    fresh = folder_tensors(model_dir, a0.path)
    assert set(fresh) == set(WeightShapes.of(a_spec).shapes)
    assert all(not t.any() for t in fresh.values())

    update = random_update(a_spec, seed=1)
    a1 = table.prepare("job_a", update)
    assert table.served("job_a") == a0, "prepared, not yet served"
    assert table.commit("job_a", a1) == a0  # the previous one, for vLLM to remove
    assert table.served("job_a") == a1 and a1.lora_id not in (a0.lora_id, b0.lora_id)
    assert not a0.path.exists(), "the replaced version's folder is deleted"
    got = folder_tensors(model_dir, a1.path)
    assert all(torch.equal(got[n], update[n]) for n in update)
    assert table.served("job_b") == b0 and b0.path.is_dir(), "job_b's adapter untouched"
    assert all(not t.any() for t in folder_tensors(model_dir, b0.path).values())

    # the same tensors sent again (a retried sync) get a new id: vLLM caches by id
    a2 = table.prepare("job_a", update)
    table.commit("job_a", a2)
    assert a2.lora_id not in (a0.lora_id, a1.lora_id, b0.lora_id)

    # a part of an update keeps the rest of the adapter
    name = next(iter(update))
    a3 = table.prepare("job_a", {name: torch.ones_like(update[name])})
    again = folder_tensors(model_dir, a3.path)
    assert torch.equal(again[name], torch.ones_like(update[name]))
    assert all(torch.equal(again[n], update[n]) for n in update if n != name)
    table.discard(a3)  # vLLM refused it: the served version stays
    assert not a3.path.exists() and table.served("job_a") == a2


def test_a_bad_update_or_spec_changes_nothing_and_names_what_is_wrong(
    table: AdapterTable, model_dir: Path
) -> None:
    a0 = table.add("job_a", spec_of(model_dir, 4))
    table.commit("job_a", a0)
    folders = sorted(p.name for p in (table.root / "job_a").iterdir())
    with pytest.raises(WeightUpdateError, match="does not have"):
        table.prepare("job_a", {"model.embed_tokens.weight": torch.zeros(1)})  # a base tensor
    b_names = WeightShapes.of(spec_of(model_dir, 8)).shapes
    with pytest.raises(WeightUpdateError, match="shape"):  # job_b's rank-8 tensor, same name
        table.prepare("job_a", {n: torch.zeros(s) for n, s in list(b_names.items())[:1]})
    assert sorted(p.name for p in (table.root / "job_a").iterdir()) == folders
    assert table.served("job_a") == a0

    with pytest.raises(ValueError, match="LoRA jobs only"):
        table.add("job_f", ModelSpec(base_model=str(model_dir), finetune="full"))
    with pytest.raises(ValueError, match="serves base model"):
        table.add("job_o", ModelSpec(base_model="other/model", finetune="lora"))
    with pytest.raises(ValueError, match="rank 16 is above .* max_lora_rank 8"):
        table.add("job_r", spec_of(model_dir, 16))
    with pytest.raises(ValueError, match="already loaded"):
        table.add("job_a", spec_of(model_dir, 4))
    table.commit("job_b", table.add("job_b", spec_of(model_dir, 4)))
    with pytest.raises(ValueError, match="started for 2 adapters"):
        table.add("job_c", spec_of(model_dir, 4))
    assert table.adapters == ["job_a", "job_b"]


def test_removing_a_job_frees_its_adapter_and_folders(table: AdapterTable, model_dir: Path) -> None:
    a0 = table.add("job_a", spec_of(model_dir, 4))
    table.commit("job_a", a0)
    assert table.remove("job_a") == a0  # the served version, for vLLM to remove
    assert not (table.root / "job_a").exists()
    with pytest.raises(ValueError, match="not loaded"):
        table.served("job_a")
    assert table.remove("job_a") is None  # a second remove is harmless
    b0 = table.add("job_b", spec_of(model_dir, 4))  # the slot is free again
    assert b0.lora_id > a0.lora_id, "ids are never reused"


def test_each_row_is_one_request_with_its_jobs_adapter_and_seed(
    table: AdapterTable, model_dir: Path
) -> None:
    for adapter in ("job_a", "job_b"):
        table.commit(adapter, table.add(adapter, spec_of(model_dir, 4)))
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12)
    rows = [
        LoraRow([5, 6, 7], "job_a", sampling, seed=11),
        LoraRow([8, 9], "job_b", sampling, seed=12),
        LoraRow([5, 6, 7], "job_a", sampling, seed=13, greedy=True),
    ]
    requests = row_requests(rows, table, EOS)
    assert [r.lora for r in requests] == [
        table.served("job_a"),
        table.served("job_b"),
        table.served("job_a"),
    ]
    assert [r.prompt for r in requests] == [
        {"prompt_token_ids": [5, 6, 7]},
        {"prompt_token_ids": [8, 9]},
        {"prompt_token_ids": [5, 6, 7]},
    ]
    assert requests[0].sampling == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 12,
        "seed": 11,
        "logprobs": 0,
        "stop_token_ids": [EOS],
        "detokenize": False,
    }
    assert requests[1].sampling["seed"] == 12
    assert (requests[2].sampling["temperature"], requests[2].sampling["top_p"]) == (0.0, 1.0)
    with pytest.raises(ValueError, match="'job_x' is not loaded"):
        row_requests([*rows, LoraRow([1], "job_x", sampling, seed=0)], table, EOS)
    with pytest.raises(ValueError, match="empty prompt"):
        row_requests([LoraRow([], "job_a", sampling, seed=0)], table, EOS)


def test_engine_options_size_the_lora_slots_by_capacity_and_rank() -> None:
    settings = RolloutSettings(gpu_memory_utilization=0.4)
    options = multi_lora_options("m", settings, "cuda:0", capacity=4, max_lora_rank=12)
    assert options["enable_lora"] and options["max_lora_rank"] == 16  # vLLM's slot for 12
    assert (options["max_loras"], options["max_cpu_loras"]) == (4, 5)
    assert options["model"] == "m" and options["dtype"] == "bfloat16"
    assert options["gpu_memory_utilization"] == 0.4
    with pytest.raises(ConfigError, match="runs on CUDA"):
        multi_lora_options("m", settings, "cpu", capacity=4, max_lora_rank=8)
    with pytest.raises(ValueError, match="capacity of at least 1"):
        multi_lora_options("m", settings, "cuda:0", capacity=0, max_lora_rank=8)


def test_the_shared_rollout_picks_vllm_on_cuda_and_peft_on_cpu(model_dir: Path) -> None:
    shared = {"base_model": str(model_dir), "capacity": 2, "max_lora_rank": 8}
    name, load = shared_engine_loader(
        RolloutSettings(device="cpu"), cuda_available=False, vllm_importable=True, **shared
    )
    assert name == "transformers"
    engine = load()
    assert isinstance(engine, SharedLoraEngine) and engine.device.type == "cpu"
    name, _ = shared_engine_loader(
        RolloutSettings(), cuda_available=True, vllm_importable=True, **shared
    )
    assert name == "vllm"  # chosen, not loaded: that needs the GPU
    name, _ = shared_engine_loader(
        RolloutSettings(), cuda_available=True, vllm_importable=False, **shared
    )
    assert name == "transformers"  # CUDA without vllm: peft's mixed batches on the GPU
    with pytest.raises(ConfigError, match="needs CUDA devices") as on_cpu:
        shared_engine_loader(
            RolloutSettings(engine="vllm", device="cpu"),
            cuda_available=False,
            vllm_importable=True,
            **shared,
        )
    assert on_cpu.value.reason == "VLLM_NEEDS_CUDA"
    assert "vllm" not in sys.modules
