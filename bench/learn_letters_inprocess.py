"""How fast does a random-init tiny Qwen2 learn the `letter` task with GRPO? (one process, no gRPC)

The trainer's own Policy and grpo_update, with sampling done in-process by the rollout's
TransformersEngine on the policy's model.
Task: system "You answer with a single capital letter.", user "Answer with the letter K."
(K uniform among the first --num-letters letters); reward 1.0 iff the stripped response starts
with K. Prints the mean reward every --report-every steps and steps/s, and writes a JSON
summary with --out.

    .venv/bin/python bench/learn_letters_inprocess.py --num-letters 4 --max-new-tokens 2 --lr 1e-4
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import string
import tempfile
import time
from pathlib import Path

import torch

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.rollout.agent.chat_format import decode
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.batch import Episode
from opentinker.services.trainer.rl.training import grpo_update
from opentinker.spec import ModelSpec, SamplingParams

SYSTEM = "You answer with a single capital letter."


@functools.cache
def letter_prompt(tokenizer, letter: str, with_system: bool = True) -> list[int]:
    user = {"role": "user", "content": f"Answer with the letter {letter}."}
    messages = [{"role": "system", "content": SYSTEM}, user] if with_system else [user]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return [int(i) for i in ids]


def letter_reward(text: str, letter: str, alphabet: str, format_reward: float) -> float:
    """The letter env's reward: 1 for the named letter, format_reward for another valid one."""
    answer = text.strip()
    if answer.startswith(letter):
        return 1.0
    return format_reward if answer[:1] and answer[0] in alphabet else 0.0


@torch.no_grad()
def sample_group_batch(
    policy: Policy,
    letters: list[str],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    with_system: bool = True,
    alphabet: str = string.ascii_uppercase,
    format_reward: float = 0.0,
) -> tuple[list[Episode], int]:
    """Sample group_size completions per letter; return episodes and generated token count."""
    tok = policy.tokenizer
    prompts = [letter_prompt(tok, k, with_system) for k in letters for _ in range(group_size)]
    # The rollout's own engine on the policy's model: the same sampling code as the mesh's.
    engine = TransformersEngine(policy.model, tok)
    policy.model.eval()
    completions = engine.generate(
        prompts,
        SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens),
        seed=int(torch.randint(2**31, ())),  # from torch's RNG, which the caller seeds
    )
    policy.model.train()
    episodes: list[Episode] = []
    generated = 0
    for i, (prompt, sampled) in enumerate(zip(prompts, completions, strict=True)):
        completion = sampled.token_ids  # up to and including eos
        generated += len(completion)
        letter = letters[i // group_size]
        text = decode(tok, completion, skip_special_tokens=True)
        episodes.append(
            Episode(
                group_index=i // group_size,
                policy_version=0,
                token_ids=prompt + completion,
                prompt_length=len(prompt),
                logprobs=sampled.logprobs,
                loss_mask=[1] * len(completion),
                reward=letter_reward(text, letter, alphabet, format_reward),
                env_error=False,
            )
        )
    return episodes, generated


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-letters", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--finetune", choices=["full", "lora"], default="full")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--time-limit-s", type=float, default=180.0)
    parser.add_argument(
        "--stop-at", type=float, default=0.95, help="stop when the 10-step mean reaches this"
    )
    parser.add_argument("--report-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format-reward", type=float, default=0.0)
    parser.add_argument(
        "--no-system",
        action="store_true",
        help="drop the system message (shorter prompts, faster steps)",
    )
    parser.add_argument(
        "--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "opentinker-tiny-qwen2"
    )
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args()


class Run:
    """What a training run measured: the mean reward of each step (in [0, 1]), and the curve
    of (step, mean reward over the last 10 steps, seconds since the start) it reported.
    Not a dataclass: tests load this file by path, without a sys.modules entry, which
    dataclasses need."""

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = 0.0
        self.rewards: list[float] = []
        self.curve: list[tuple[int, float, float]] = []


def train(policy: Policy, args: argparse.Namespace) -> Run:
    """GRPO steps until --steps, --time-limit-s, or the 10-step mean reward reaches --stop-at;
    prints a line every --report-every steps."""
    rng = random.Random(args.seed)
    alphabet = string.ascii_uppercase[: args.num_letters]
    run = Run()
    accuracy: list[float] = []  # fraction answering the named letter
    start = time.monotonic()
    while run.steps < args.steps and time.monotonic() - start < args.time_limit_s:
        letters = [rng.choice(alphabet) for _ in range(args.prompts)]
        episodes, _ = sample_group_batch(
            policy,
            letters,
            args.samples,
            args.max_new_tokens,
            1.0,
            not args.no_system,
            alphabet,
            args.format_reward,
        )
        stats = grpo_update(policy, episodes, clip_epsilon=0.2, temperature=1.0)
        answers = {policy.tokenizer.decode(e.token_ids[e.prompt_length :][:1]) for e in episodes}
        run.rewards.append(sum(e.reward for e in episodes) / len(episodes))
        accuracy.append(sum(e.reward == 1.0 for e in episodes) / len(episodes))
        run.steps += 1
        last10 = sum(run.rewards[-10:]) / len(run.rewards[-10:])
        if run.steps % args.report_every == 0 or run.steps == 1:
            run.curve.append((run.steps, round(last10, 3), round(time.monotonic() - start, 1)))
            print(
                f"step {run.steps:5d}  reward(last10) {last10:.3f}  "
                f"accuracy(last10) {sum(accuracy[-10:]) / len(accuracy[-10:]):.3f}  "
                f"entropy {stats.entropy:.2f}  distinct first tokens {len(answers):3d}  "
                f"t {time.monotonic() - start:6.1f}s",
                flush=True,
            )
        if last10 >= args.stop_at and run.steps >= 10:
            break
    run.seconds = time.monotonic() - start
    return run


def summarize(run: Run, policy: Policy, args: argparse.Namespace) -> dict[str, object]:
    """The JSON summary: the settings that matter, speed, and the reward at start and end."""
    rewards = run.rewards
    return {
        "num_letters": args.num_letters,
        "max_new_tokens": args.max_new_tokens,
        "lr": args.lr,
        "format_reward": args.format_reward,
        "finetune": args.finetune,
        "system_prompt": not args.no_system,
        "prompt_tokens": len(letter_prompt(policy.tokenizer, "A", not args.no_system)),
        "steps": run.steps,
        "seconds": round(run.seconds, 1),
        "steps_per_s": round(run.steps / run.seconds, 2),
        "reward_first10": round(sum(rewards[:10]) / len(rewards[:10]), 3),
        "reward_last10": round(sum(rewards[-10:]) / len(rewards[-10:]), 3),
        "reached_stop_at": sum(rewards[-10:]) / len(rewards[-10:]) >= args.stop_at,
        "curve": run.curve,
    }


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    model_dir = ensure_tiny_model(args.model_dir)
    policy = Policy(
        ModelSpec(base_model=str(model_dir), finetune=args.finetune), learning_rate=args.lr
    )
    summary = summarize(train(policy, args), policy, args)
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
