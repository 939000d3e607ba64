"""A GRPO update on multi-turn episodes of unequal length: one forward pass padded to the
longest episode, against passes of like-length episodes (``max_padding_fraction``, default
0.25: a pass is cut where more of it would be padding), in one run.

The episodes are ``bench/loss_positions.py``'s: a prompt, then 1 to ``--turns`` turns of model
tokens and env replies, so their lengths differ up to ``--turns``-fold. The whole update
(``rl_update``: advantages, forward, backward, optimizer step) runs on the tiny Qwen2 shape
(random init, built here), calls alternating; medians are printed with the ratio and the
tokens each way computes.

    .venv/bin/python bench/padding_passes.py [--calls 5] [--turns 8] [--hidden-size 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from arguments import positive_int  # bench/ is sys.path[0]
from loss_positions import add_episode_arguments, multi_turn_episodes

from opentinker.services.modeling.tiny_model import ensure_scaled_model
from opentinker.services.trainer.model.microbatch import group_by_token_budget
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.batch_work import UpdateConfig
from opentinker.services.trainer.rl.training import rl_update
from opentinker.spec import ModelSpec

SIDES = {"one padded pass": 1.0, "like-length passes": 0.25}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=positive_int, default=5, help="updates per side")
    parser.add_argument("--hidden-size", type=positive_int, default=128)
    parser.add_argument("--layers", type=positive_int, default=2)
    add_episode_arguments(
        parser, groups=4, turns=8, prompt_tokens=150, model_tokens=30, env_tokens=100
    )
    args = parser.parse_args()
    folder = Path(tempfile.gettempdir()) / f"opentinker-bench-h{args.hidden_size}-l{args.layers}"
    model_dir = ensure_scaled_model(folder, hidden_size=args.hidden_size, num_layers=args.layers)
    policy = Policy(ModelSpec(base_model=str(model_dir), finetune="full"), learning_rate=1e-6)
    episodes = multi_turn_episodes(args, vocab=500)
    lengths = [len(e.token_ids) for e in episodes]
    out = sys.stdout
    out.write(f"{len(episodes)} episodes of 1-{args.turns} turns, {sum(lengths):,} tokens "
              f"(lengths {min(lengths)}-{max(lengths)}), hidden {args.hidden_size}, "
              f"{args.layers} layers, torch threads {torch.get_num_threads()}\n")  # fmt: skip
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for round_index in range(args.calls + 1):  # one warm-up round
        for side, max_padding in SIDES.items():
            started = time.perf_counter()
            rl_update(policy, episodes, UpdateConfig(max_padding=max_padding))
            if round_index:
                times[side].append(time.perf_counter() - started)
    for side, max_padding in SIDES.items():
        passes = group_by_token_budget(lengths, 0, max_padding)
        padded = sum(len(p) * max(lengths[i] for i in p) for p in passes)
        out.write(f"{side:<20} {statistics.median(times[side]) * 1000:8.1f} ms   "
                  f"{len(passes)} passes, {padded:,} padded tokens\n")  # fmt: skip
    ratio = statistics.median(times["one padded pass"]) / statistics.median(
        times["like-length passes"]
    )
    out.write(f"like-length passes are {ratio:.2f}x as fast\n")


if __name__ == "__main__":
    main()
