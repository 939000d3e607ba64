"""What a second CPU thread buys the demo's compute: generate and train, 1 thread vs 2.

The demo task in one process (bench/vs_inprocess.py's in-process run: tiny Qwen2, letter
reward, 16 prompts x 8 samples, lr 1e-4, full fine-tuning); steps alternate between 1 and 2
torch threads, and the second half of the run (when groups have mixed rewards, so training
has rows to train on) is averaged per thread count. Splitting the cores between the rollout
and the trainer (staleness >= 1, each on its own core) costs a step at least max(generate,
train) on 1 thread; running both in turn on 2 threads costs generate + train on 2. When 2
threads are close to 2x one, the split cannot win; the further from it, the more it can.

    .venv/bin/python bench/thread_scaling.py [--steps 700]
"""

from __future__ import annotations

import argparse
import random
import string
import sys
import tempfile
from pathlib import Path

import torch
from vs_inprocess import demo_step  # bench/ is sys.path[0]

from opentinker.services.launcher.demo import demo_spec
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.batch_work import UpdateConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=700)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="opentinker-thread-scaling-"))
    spec = demo_spec(ensure_tiny_model(root / "tiny-qwen2"), threshold=1.0, max_steps=args.steps)
    rl = spec.rl
    assert rl is not None
    torch.manual_seed(rl.seed)
    policy = Policy(spec.model, learning_rate=rl.learning_rate)
    config = UpdateConfig.from_rl(rl)
    rng = random.Random(rl.seed)
    alphabet = string.ascii_uppercase[: int(rl.env_options["num_letters"])]
    totals = {1: [0.0, 0.0, 0], 2: [0.0, 0.0, 0]}  # threads -> generate s, train s, steps
    for step in range(args.steps):
        threads = 1 + step % 2
        torch.set_num_threads(threads)
        _, generate_s, train_s = demo_step(policy, rl, config, rng, alphabet)
        if step >= args.steps // 2:
            total = totals[threads]
            total[0] += generate_s
            total[1] += train_s
            total[2] += 1
    out = sys.stdout
    means = {t: (g / n, tr / n) for t, (g, tr, n) in totals.items()}
    for threads, (generate, train) in means.items():
        out.write(f"{threads} thread(s): generate {generate:.4f} s, train {train:.4f} s a step\n")
    (g1, t1), (g2, t2) = means[1], means[2]
    out.write(f"2 threads vs 1: generate {g1 / g2:.2f}x faster, train {t1 / t2:.2f}x faster\n")


if __name__ == "__main__":
    main()
