"""A short real-size RL job on one GPU with the vLLM rollout engine: the whole mesh (Redis,
scheduler, EnvHub, worker -> trainer + rollout processes) on a Qwen2.5-0.5B-shaped model built
here with random init, LoRA or full fine-tuning; prints the step time split and weight sync.

    python bench/gpu_rl.py --finetune lora [--steps 8] [--prompts 16] [--samples 8]

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
from pathlib import Path

from step_breakdown import KEYS  # bench/ is sys.path[0]: the same step split

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import QWEN2_5_0_5B_SHAPE, build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finetune", choices=["full", "lora"], default="lora")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, help="a model folder (default: build one)")
    args = parser.parse_args()
    os.environ.setdefault("OPENTINKER_ROLLOUT_ENGINE", "vllm")
    os.environ.setdefault("OPENTINKER_ROLLOUT_GPU_MEMORY_UTILIZATION", "0.3")
    root = Path(tempfile.mkdtemp(prefix="opentinker-gpu-rl-"))
    model = args.model or build_tiny_model(root / "qwen0.5b", **QWEN2_5_0_5B_SHAPE)
    spec = JobSpec(
        name=f"gpu-rl-{args.finetune}",
        model=ModelSpec(base_model=str(model), finetune=args.finetune),
        rl=RlConfig(
            env_name="letter",
            env_options={"num_letters": "8"},
            steps=args.steps,
            prompts_per_step=args.prompts,
            samples_per_prompt=args.samples,
            learning_rate=1e-5,
            sampling=SamplingParams(max_new_tokens=args.max_new_tokens),
        ),
    )
    steps = []  # client.fit raises JobFailedError (with the reason) when the job fails
    with (
        LocalMesh(MeshSettings(run_root=root / "mesh", warm_spares=0)) as mesh,
        opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client,
    ):
        job = client.fit(spec, on_event=lambda e: steps.append(e) if e.kind == "step" else None)
        logs = mesh.log_dir
    out = sys.stdout
    out.write(f"job {job.job_id} {job.state} ({args.finetune}); logs under {logs}\n")
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


if __name__ == "__main__":
    main()
