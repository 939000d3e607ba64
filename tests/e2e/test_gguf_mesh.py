"""A model imported from GGUF (a tiny random Llama with tied embeddings, as SmolLM2 is,
written as Q8_0 by tests/support/gguf_files.py) through the whole mesh: LoRA and full RL, and its
saved adapter served by an inference job. Llama beside the Qwen2 every other test uses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gguf_files import tiny_llama, write_llama_gguf

import opentinker
from opentinker import InferenceConfig, JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.errors import JobFailedError
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.gguf_import import import_gguf

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    return write_llama_gguf(folder / "tiny.gguf", tiny_llama(seed=1, tied=True), quantize="Q8_0")


@pytest.fixture(scope="module")
def llama(gguf_file: Path) -> Path:
    import_gguf(gguf_file, gguf_file.parent / "hf")
    return gguf_file.parent / "hf"


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mesh")


@pytest.fixture(scope="module")
def mesh(run_root: Path):
    with LocalMesh(MeshSettings(run_root=run_root)) as running:
        yield running


@pytest.fixture(scope="module")
def client(mesh):
    return opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10)


def rl(model: Path, finetune: str, steps: int = 2) -> JobSpec:
    config = RlConfig(
        env_name="letter",
        env_options={"num_letters": "4"},
        steps=steps,
        prompts_per_step=4,
        samples_per_prompt=4,
        learning_rate=1e-3,
        sampling=SamplingParams(max_new_tokens=2),
    )
    return JobSpec(
        name=f"llama-{finetune}",
        model=ModelSpec(base_model=str(model), finetune=finetune),
        rl=config,
    )


def test_an_imported_llama_trains_with_lora_and_its_adapter_serves(client, llama: Path) -> None:
    job = client.fit(rl(llama, "lora"), timeout=300)
    assert job.state == "SUCCEEDED", job.reason
    assert job.final_metrics["policy_version"] == 2
    served = client.fit(
        JobSpec(
            kind="inference",
            model=ModelSpec(base_model=str(llama)),
            inference=InferenceConfig(
                env_name="letter", episodes=4, adapter_dir=job.checkpoint_uri
            ),
        ),
        timeout=300,
    )
    assert served.state == "SUCCEEDED", served.reason
    assert served.final_metrics["episodes"] == 4


def test_an_imported_llama_trains_all_its_weights_and_keeps_them_tied(client, llama: Path) -> None:
    job = client.fit(rl(llama, "full"), timeout=300)
    assert job.state == "SUCCEEDED", job.reason
    assert job.final_metrics["policy_version"] == 2
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(llama)
    after = AutoModelForCausalLM.from_pretrained(job.checkpoint_uri)
    assert after.config.model_type == "llama" and after.config.tie_word_embeddings
    assert after.lm_head.weight is after.model.embed_tokens.weight  # one matrix, as saved
    assert sorted(n for n, _ in after.named_parameters()) == sorted(
        n for n, _ in before.named_parameters()
    )


def test_a_gguf_file_named_as_the_base_model_is_imported_once_by_the_worker(
    client, gguf_file: Path, run_root: Path, tmp_path: Path
) -> None:
    one_step = rl(gguf_file, "lora", steps=1)
    for _ in range(2):
        job = client.fit(one_step, timeout=300)
        assert job.state == "SUCCEEDED", job.reason
    imported = [p for p in run_root.rglob("models/tiny-*") if p.is_dir()]
    assert len(imported) == 1 and (imported[0] / "model.safetensors").exists()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(JobFailedError) as failed:
        client.fit(rl(broken, "lora"), timeout=300)
    assert "model.base_model" in str(failed.value) and "could not import it" in str(failed.value)


def test_eval_reports_accuracy_with_its_interval_on_a_validation_split(
    mesh, llama: Path, tmp_path: Path
) -> None:
    """`opentinker eval` on the countdown task's validation split, the model against itself:
    the same episodes, so the paired difference is exactly zero."""
    import subprocess
    import sys

    env = {**os.environ, "OPENTINKER_API_KEY": mesh.api_key}
    out = subprocess.run(
        [sys.executable, "-m", "opentinker", "--scheduler", mesh.scheduler_address, "eval",
         "--model", str(llama), "--compare-model", str(llama), "--env", "countdown",
         "--episodes", "6", "--max-new-tokens", "8", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    said = " ".join(out.stdout.split())
    assert out.returncode == 0, said + out.stderr
    assert said.count("accuracy 0.0% (95% CI 0.0%–39.0%)") == 2, said  # Wilson, 0 of 6
    assert "difference (compared - model) in accuracy: +0.0% (95% CI +0.0% to +0.0%" in said
    rows = (tmp_path / "model.jsonl").read_text().splitlines()
    assert len(rows) == 6 and all('"outcome"' in r for r in rows)
