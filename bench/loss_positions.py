"""The output head on the trained positions only, against every position, in one run.

A training forward + backward (``policy_forward`` with the batch's prompt groups, the loss
on the trained tokens) on multi-turn episodes: a prompt, then turns of model tokens (trained)
and env replies (loss mask 0), episodes of unequal length (padding). The model is the tiny
Qwen2 shape with Qwen2.5's 151,936-token vocabulary (random init, built here), where the
head's matrix product and log-softmax are a large share of a small model's work per
position. Calls alternate between the two sides; medians are printed with the ratio.

    .venv/bin/python bench/loss_positions.py [--calls 5] [--hidden-size 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from arguments import positive_int  # bench/ is sys.path[0]

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer.model.forward import policy_forward
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.model.shared_prompts import prompt_groups
from opentinker.services.trainer.rl.batch import Episode, collate
from opentinker.spec import ModelSpec

QWEN_VOCAB = 151_936


def add_episode_arguments(
    parser: argparse.ArgumentParser,
    *,
    groups: int,
    turns: int,
    prompt_tokens: int,
    model_tokens: int,
    env_tokens: int,
) -> None:
    """The episode shape ``multi_turn_episodes`` reads, with these defaults."""
    parser.add_argument("--groups", type=positive_int, default=groups)
    parser.add_argument("--samples", type=positive_int, default=4, help="episodes per group")
    parser.add_argument("--turns", type=positive_int, default=turns, help="most turns an episode")
    parser.add_argument("--prompt-tokens", type=positive_int, default=prompt_tokens)
    parser.add_argument("--model-tokens", type=positive_int, default=model_tokens, help="per turn")
    parser.add_argument("--env-tokens", type=positive_int, default=env_tokens, help="per reply")


def multi_turn_episodes(args: argparse.Namespace, vocab: int) -> list[Episode]:
    """``groups`` x ``samples`` episodes; each plays 1..turns turns of model then env tokens."""
    rng = random.Random(0)
    episodes = []
    for group in range(args.groups):
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
        for sample in range(args.samples):
            completion, mask = [], []
            for turn in range(1 + (group + sample) % args.turns):
                if turn:  # the env's reply to the previous turn
                    completion += [rng.randrange(vocab) for _ in range(args.env_tokens)]
                    mask += [0] * args.env_tokens
                completion += [rng.randrange(vocab) for _ in range(args.model_tokens)]
                mask += [1] * args.model_tokens
            logprobs = [-1.0] * len(completion)
            reward = float(sample % 2)
            episodes.append(
                Episode(group, 0, prompt + completion, len(prompt), logprobs, mask, reward, False)
            )
    return episodes


def step_ms(policy: Policy, episodes: list[Episode], calls: int) -> tuple[float, float]:
    """Median ms of a forward + backward with the head everywhere, and at the trained tokens."""
    batch = collate(episodes, policy.pad_id)
    groups = prompt_groups(episodes)
    mask_B_T = batch.loss_mask_B_T

    def call(wanted_B_T: torch.Tensor | None) -> float:
        started = time.perf_counter()
        policy.model.zero_grad(set_to_none=True)
        out = policy_forward(policy, batch, temperature=1.0, groups=groups, wanted_B_T=wanted_B_T)
        ((out.logprobs_B_T + 0.01 * out.entropy_B_T) * mask_B_T).sum().backward()
        return (time.perf_counter() - started) * 1000

    times: dict[str, list[float]] = {"every": [], "trained": []}
    for round_index in range(calls + 1):  # one warm-up round
        for side, wanted in (("every", None), ("trained", mask_B_T > 0)):
            ms = call(wanted)
            if round_index:
                times[side].append(ms)
    return statistics.median(times["every"]), statistics.median(times["trained"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=positive_int, default=5, help="calls per side")
    parser.add_argument("--hidden-size", type=positive_int, default=256)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--vocab", type=positive_int, default=QWEN_VOCAB)
    add_episode_arguments(
        parser, groups=2, turns=3, prompt_tokens=96, model_tokens=24, env_tokens=72
    )
    args = parser.parse_args()
    folder = Path(tempfile.gettempdir()) / (
        f"opentinker-bench-vocab{args.vocab}-h{args.hidden_size}-l{args.layers}"
    )
    model_dir = ensure_tiny_model(folder, hidden_size=args.hidden_size,
                                  num_layers=args.layers, intermediate_size=4 * args.hidden_size,
                                  vocab_size=args.vocab)  # fmt: skip
    policy = Policy(ModelSpec(base_model=str(model_dir), finetune="full"), learning_rate=1e-4)
    episodes = multi_turn_episodes(args, args.vocab)
    batch = collate(episodes, policy.pad_id)
    trained = int(batch.loss_mask_B_T.sum())
    out = sys.stdout
    params = sum(p.numel() for p in policy.model.parameters()) / 1e6
    out.write(f"model: hidden {args.hidden_size}, {args.layers} layers, vocab {args.vocab} "
              f"({params:.1f}M parameters), torch threads {torch.get_num_threads()}\n")  # fmt: skip
    out.write(f"batch: {len(episodes)} episodes, {batch.loss_mask_B_T.numel()} positions, "
              f"{trained} trained ({trained / batch.loss_mask_B_T.numel():.0%})\n")  # fmt: skip
    every, only = step_ms(policy, episodes, args.calls)
    out.write(f"forward + backward   head everywhere {every:8.1f} ms   "
              f"on trained tokens {only:8.1f} ms   {every / only:4.2f}x\n")  # fmt: skip


if __name__ == "__main__":
    main()
