"""End to end through the real mesh (Redis, scheduler, envhub, worker and the processes it
starts): an SFT job lowers validation loss and its LoRA checkpoint answers in the trained
format; an RL job then starts from that adapter, with the weight-sync probe passing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sft_helpers import answer_format_rows, write_jsonl

import opentinker
from opentinker import JobSpec, LoraConfig, ModelSpec, RlConfig, SamplingParams, SftConfig
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import ensure_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Attention-only LoRA barely moves a random-init model; every linear layer learns the format.
LORA = LoraConfig(
    rank=16,
    alpha=32.0,
    target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)
ADAPTER = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with LocalMesh(MeshSettings(run_root=tmp_path_factory.mktemp("mesh"))) as running:
        yield running


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def greedy_reply(model, tokenizer, question: str) -> str:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([list(ids)]), max_new_tokens=16, do_sample=False
        )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_sft_lora_job_learns_the_format_and_an_rl_job_starts_from_it(
    mesh, base_model: Path, tmp_path: Path
) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", answer_format_rows(160))
    sft = JobSpec(
        name="sft-e2e",
        kind="sft",
        model=ModelSpec(base_model=str(base_model), finetune="lora", lora=LORA),
        sft=SftConfig(
            dataset_path=str(data),
            validation_fraction=0.1,
            epochs=16,
            learning_rate=5e-3,
            max_tokens_per_batch=512,
            max_sequence_length=64,
            packing=True,
            eval_every=16,
        ),
    )
    # Submitted as a user would: `opentinker submit spec.json`, then followed with the SDK.
    spec_file = tmp_path / "sft.json"
    spec_file.write_text(json.dumps(sft.model_dump(mode="json")))
    cli = [sys.executable, "-m", "opentinker", "--scheduler", mesh.scheduler_address, "submit"]
    as_user = {**os.environ, "OPENTINKER_API_KEY": mesh.api_key}
    out = subprocess.run(
        [*cli, str(spec_file)], capture_output=True, text=True, timeout=60, env=as_user
    )
    assert out.returncode == 0, out.stdout + out.stderr
    submitted = re.search(r"submitted (\S+) \(QUEUED\)", out.stdout)
    assert submitted, out.stdout
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10) as client:
        events = list(client.watch(submitted.group(1), timeout=240))
        job = client.get_job(submitted.group(1))
        assert job.state == "SUCCEEDED" and job.name == "sft-e2e", job.reason
        val = [
            e.metrics["val/loss"] for e in events if e.kind == "step" and "val/loss" in e.metrics
        ]
        (attempt,) = mesh.run_root.rglob(f"{job.job_id}/attempt-1")  # the trainer alone ran
        assert (attempt / "trainer.log").is_file() and not (attempt / "rollout.log").exists()
        # First (before any step) vs last: measured 6.23 -> 3.99 nats/token (the format is
        # learned; copying the question's last word, not yet).
        initial = job.final_metrics["val/loss_initial"]
        assert len(val) >= 2 and val[-1] == job.final_metrics["val/loss"]
        assert val[-1] < initial - 1.0, (initial, val)
        print(f"SFT val/loss {initial:.3f} before training, {val} at eval steps")

        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = AutoModelForCausalLM.from_pretrained(str(base_model))
        model = PeftModel.from_pretrained(base, job.checkpoint_uri).eval()
        tokenizer = AutoTokenizer.from_pretrained(job.checkpoint_uri)
        for question in ("what is the move", "close the door", "you win"):
            assert greedy_reply(model, tokenizer, question).startswith("ANSWER: "), question

        rl = JobSpec(
            name="rl-from-sft",
            model=ModelSpec(
                base_model=str(base_model),
                finetune="lora",
                lora=LORA,
                init_adapter=job.checkpoint_uri,
            ),
            rl=RlConfig(
                env_name="letter",
                env_options={"num_letters": "1"},
                steps=2,
                prompts_per_step=2,
                samples_per_prompt=2,
                learning_rate=1e-4,
                sampling=SamplingParams(max_new_tokens=2),
            ),
        )
        rl_events = []
        rl_job = client.fit(rl, on_event=rl_events.append, timeout=240)
    assert rl_job.state == "SUCCEEDED", rl_job.reason  # a probe mismatch fails the job
    steps = [e for e in rl_events if e.kind == "step"]
    assert len(steps) == 2 and all(e.metrics["probe_max_abs_diff"] <= 1e-3 for e in steps)
    # The RL adapter is the SFT adapter moved a little, not a fresh one (whose lora_B is 0).
    sft_weights = load_file(str(Path(job.checkpoint_uri) / ADAPTER))
    rl_weights = load_file(str(Path(rl_job.checkpoint_uri) / ADAPTER))
    lora_b = [name for name in sft_weights if "lora_B" in name]
    sft_b = torch.cat([sft_weights[n].flatten() for n in lora_b])
    rl_b = torch.cat([rl_weights[n].flatten() for n in lora_b])
    assert sft_b.norm() > 0.1 and (rl_b - sft_b).norm() < 0.1 * sft_b.norm()
