"""Peak memory and seconds of one training forward+backward: shared prompts vs plain, with and
without gradient checkpointing, on GRPO groups with long prompts.

Real-size RL jobs run long prompts (a math problem, a game's rules and board), n samples each,
and often turn gradient checkpointing on. The plain forward runs each prompt n times, forward
and backward; the shared one (services/trainer/model/shared_prompts.py) runs it once and keeps its
keys and values for the rows. This measures both through the trainer's own ``policy_forward``
on a random-init Qwen2 built here (no download): hidden 256, 4 layers, full fine-tuning.

Each (checkpointing, path) runs in a fresh forked process after a small warm-up step there;
peak = the growth of the resident set's high-water mark over the step (bench/trainer_memory.py's
``peak_growth`` and ``in_fresh_process``).

    .venv/bin/python bench/shared_prompt_memory.py [--prompts 4] [--samples 8]
        [--prompt-tokens 384] [--completion-tokens 32] [--quick]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from trainer_memory import in_fresh_process, peak_growth  # bench/ is sys.path[0]

from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.trainer.model.forward import policy_forward
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.model.shared_prompts import prompt_groups
from opentinker.services.trainer.rl.batch import Episode, collate
from opentinker.spec import ModelSpec

MODEL = {"hidden_size": 256, "num_layers": 4, "intermediate_size": 768, "num_heads": 8}


def grpo_episodes(
    prompts: int, samples: int, prompt_tokens: int, completion_tokens: int, seed: int = 0
) -> list[Episode]:
    """``prompts`` random prompts with ``samples`` random completions each, rewards 0/1."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for group in range(prompts):
        prompt = torch.randint(3, 500, (prompt_tokens,), generator=gen).tolist()
        for k in range(samples):
            completion = torch.randint(3, 500, (completion_tokens,), generator=gen).tolist()
            out.append(
                Episode(group, 0, prompt + completion, prompt_tokens, [-1.0] * completion_tokens,
                        [1] * completion_tokens, float(k % 2), False)
            )  # fmt: skip
    return out


def measure(model_dir: Path, checkpointing: bool, shared: bool, args: argparse.Namespace) -> dict:
    """One forward+backward of the batch in this process: peak growth (MiB) and seconds."""
    spec = ModelSpec(
        base_model=str(model_dir), finetune="full", gradient_checkpointing=checkpointing
    )
    policy = Policy(spec, learning_rate=1e-5)

    def step(episodes: list[Episode]) -> None:
        batch = collate(episodes, policy.pad_id)
        groups = prompt_groups(episodes) if shared else None
        out = policy_forward(policy, batch, temperature=1.0, groups=groups)
        (out.logprobs_B_T * batch.loss_mask_B_T).sum().backward()

    step(grpo_episodes(2, 2, 8, 4, seed=1))  # warm-up: allocator, thread pools, autograd
    policy.model.zero_grad(set_to_none=True)
    episodes = grpo_episodes(args.prompts, args.samples, args.prompt_tokens, args.completion_tokens)
    return peak_growth(lambda: step(episodes), policy.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=384)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="a small batch (the smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.samples, args.prompt_tokens, args.completion_tokens = 2, 4, 48, 8
    for name in ("prompts", "samples", "prompt_tokens", "completion_tokens"):
        if getattr(args, name) < (2 if name in ("samples", "prompt_tokens") else 1):
            parser.error(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
    with tempfile.TemporaryDirectory(prefix="opentinker-shared-memory-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", **MODEL)
        rows = args.prompts * args.samples
        print(f"{args.prompts} prompts x {args.samples} samples = {rows} rows of "
              f"{args.prompt_tokens} + {args.completion_tokens} tokens; Qwen2 {MODEL}, full "
              f"fine-tuning, {torch.get_num_threads()} threads")  # fmt: skip
        print(f"{'checkpointing':>13} {'plain MiB':>10} {'shared MiB':>11} {'ratio':>6} "
              f"{'plain s':>8} {'shared s':>9} {'ratio':>6}")  # fmt: skip
        for checkpointing in (False, True):
            plain = in_fresh_process(measure, model_dir, checkpointing, False, args)
            shared = in_fresh_process(measure, model_dir, checkpointing, True, args)
            print(_row(checkpointing, plain, shared), flush=True)


def _row(checkpointing: bool, plain: dict, shared: dict) -> str:
    label = "on" if checkpointing else "off"
    if "error" in plain or "error" in shared:
        return f"{label:>13} {plain.get('error', '')} {shared.get('error', '')}"
    return (
        f"{label:>13} {plain['peak_mib']:10.0f} "
        f"{shared['peak_mib']:11.0f} {plain['peak_mib'] / max(shared['peak_mib'], 1e-9):5.1f}x "
        f"{plain['seconds']:8.2f} {shared['seconds']:9.2f} "
        f"{plain['seconds'] / shared['seconds']:5.1f}x"
    )


if __name__ == "__main__":
    main()
