"""A short real-size RL job on one GPU with the vLLM rollout engine: the whole mesh (Redis,
scheduler, EnvHub, worker -> trainer + rollout processes) on a Qwen2.5-0.5B-shaped model built
here with random init, LoRA or full fine-tuning; prints the step time split and weight sync.

    python bench/gpu_rl.py --finetune lora [--steps 8] [--prompts 16] [--samples 8]

The env is ``visible_text`` (served here, registered with the mesh's EnvHub as a user's env
is): its reward is the answer's visible length, up to 16 characters. The random model's ids
are mostly past the local 512-token tokenizer and decode to nothing, so a few answers in each
group hold text and the rewards differ from the first step: every step trains, and the probe
shift and the trainer-to-vLLM logprob gap are measured. (On the letter task such a model earns
0 everywhere: no gradient, nothing moves; so it ran on 2026-11-26.)

The worker leases the GPU, so the trainer runs in bf16 on it and the rollout picks vLLM
(OPENTINKER_ROLLOUT_ENGINE=vllm is set here: a fall back to transformers fails the job
instead of passing silently). Both processes share the GPU: vLLM takes
OPENTINKER_ROLLOUT_GPU_MEMORY_UTILIZATION of it (0.3 here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from step_breakdown import KEYS  # bench/ is sys.path[0]: the same step split

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.env_server import serve
from opentinker.game import AbstractGame, StepResult
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import QWEN2_5_0_5B_SHAPE, build_tiny_model


class VisibleText(AbstractGame):
    """Single turn: the reward is the answer's visible length (stripped), 16 characters = 1."""

    name = "visible_text"
    description = "Say something visible: reward = stripped length / 16, at most 1."
    max_turns = 1

    def get_system_prompt(self) -> str:
        return "You write a short sentence."

    def reset(self, *, seed: int = 0) -> str:
        return f"Write sentence number {seed}."

    def step(self, action: str) -> StepResult:
        reward = min(len(action.strip()) / 16, 1.0)
        return StepResult(observation="", reward=reward, done=True, info={})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finetune", choices=["full", "lora"], default="lora")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, help="a model folder (default: build one)")
    parser.add_argument("--engine", default="vllm", help="the rollout engine (CPU: transformers)")
    args = parser.parse_args()
    os.environ.setdefault("OPENTINKER_ROLLOUT_ENGINE", args.engine)
    os.environ.setdefault("OPENTINKER_ROLLOUT_GPU_MEMORY_UTILIZATION", "0.3")
    root = Path(tempfile.mkdtemp(prefix="opentinker-gpu-rl-"))
    model = args.model or build_tiny_model(root / "qwen0.5b", **QWEN2_5_0_5B_SHAPE)
    spec = JobSpec(
        name=f"gpu-rl-{args.finetune}",
        model=ModelSpec(base_model=str(model), finetune=args.finetune),
        rl=RlConfig(
            env_name=VisibleText.name,
            steps=args.steps,
            prompts_per_step=args.prompts,
            samples_per_prompt=args.samples,
            learning_rate=1e-5,
            sampling=SamplingParams(max_new_tokens=args.max_new_tokens),
        ),
    )
    steps, step_at = [], []  # client.fit raises JobFailedError (with the reason) on failure

    def on_event(event: opentinker.JobEvent) -> None:
        if event.kind == "step":
            steps.append(event)
            step_at.append(time.monotonic())

    with (
        LocalMesh(MeshSettings(run_root=root / "mesh", warm_spares=0)) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client,
    ):
        env = serve(
            VisibleText, envhub_address=mesh.envhub_address, api_key=mesh.api_key, block=False
        )
        submitted = time.monotonic()
        try:
            job = client.fit(spec, on_event=on_event)
        finally:
            env.stop(0)
        job_s = time.monotonic() - submitted
        logs = mesh.log_dir
    out = sys.stdout
    out.write(f"job {job.job_id} {job.state} ({args.finetune}); logs under {logs}\n")
    if steps:  # the start: lease, trainer and rollout processes, model loads, vLLM's warm-up
        first = steps[0].metrics["time_step_s"]
        out.write(f"job {job_s:.1f} s; submit to step 1 done {step_at[0] - submitted:.1f} s ")
        out.write(f"(step 1 itself {first:.1f} s)\n")
    measured = steps[1:] or steps  # the first step includes vLLM's warm-up
    if not measured:
        sys.exit("no step finished: see the rollout and trainer logs above")
    step_s = statistics.fmean(s.metrics["time_step_s"] for s in measured)
    out.write(f"{len(measured)} steps measured, {args.prompts * args.samples} episodes/step\n")
    out.write(f"{'part':<18}{'s/step':>10}{'share':>9}\n")
    for key in KEYS:
        mean = statistics.fmean(s.metrics.get(key, 0.0) for s in measured)
        name = key.removeprefix("time_").removesuffix("_s")
        out.write(f"{name:<18}{mean:>10.4f}{mean / step_s:>9.1%}\n")
    out.write(f"{'step total':<18}{step_s:>10.4f}\n")
    for key in ("tokens_per_s", "probe_max_abs_diff", "probe_shift", "logprob_gap", "reward_mean"):
        values = [s.metrics[key] for s in measured if key in s.metrics]
        if values:
            out.write(f"{key}: mean {statistics.fmean(values):.4g}, max {max(values):.4g}\n")
    rewards = [s.metrics.get("reward_mean", 0.0) for s in steps]
    out.write(f"reward_mean by step: {' '.join(f'{r:.3f}' for r in rewards)}\n")


if __name__ == "__main__":
    main()
