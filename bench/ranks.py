"""Step time of one RL job on 1 trainer rank against 2 ranks (FSDP2 over gloo on CPU), through
the real single-node mesh (Redis, scheduler, EnvHub, a worker with 2 CPU slots -> rollout +
1 or 2 trainer ranks per job) with the tiny model, nudged to answer with some letter A..D so
every step has reward signal (an update), on the demo's task with 4 letters (full fine-tune,
16 prompts x 8 samples per step).

Printed per rank count: s/step (wall-clock between consecutive step events, the start-up step
left out) and the mean of the steps' own train / weight-sync / generate seconds. On a CPU
machine the ranks share the cores with the rollout, so 2 ranks only pay off once a rank has
cores (or a GPU) of its own; the figure shows what the collectives cost here.

    .venv/bin/python bench/ranks.py [--steps 12] [--ranks 1,2]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path
from statistics import mean

import structlog
import torch
from scaling import JobFigures, job
from transformers import AutoModelForCausalLM, AutoTokenizer

import opentinker
from opentinker.jobs import JobEvent
from opentinker.services.envhub.games.letter_env import LetterGame
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import ensure_tiny_model

SPLIT = ("time_train_s", "time_weight_sync_s", "time_generate_s")


def letter_model(random_init: Path, out: Path) -> Path:
    """``random_init`` a few supervised steps towards answering with one of A..D (as the
    tests' ``letter_model_dir``): mixed rewards, so GRPO updates from the first step."""
    model = AutoModelForCausalLM.from_pretrained(random_init, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(random_init)
    torch.manual_seed(0)
    system = LetterGame().get_system_prompt()
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "Answer."}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    ids_1_L = torch.tensor([list(prompt)])
    letters = torch.tensor([tokenizer.convert_tokens_to_ids(k) for k in "ABCD"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(8):
        logp_1_V = torch.log_softmax(model(input_ids=ids_1_L).logits[:, -1], -1)
        (-logp_1_V[:, letters].logsumexp(-1).mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per job")
    parser.add_argument("--ranks", default="1,2", help="trainer ranks (devices) per job")
    args = parser.parse_args()
    counts = [int(n) for n in args.ranks.split(",") if n]
    with tempfile.TemporaryDirectory(prefix="opentinker-ranks-") as tmp:
        root = Path(tmp)
        model_dir = letter_model(ensure_tiny_model(root / "tiny-qwen2"), root / "letters")
        settings = MeshSettings(run_root=root / "mesh", warm_spares=0, cpu_slots=max(counts))
        print(f"== one job, {args.steps} steps, 16 x 8 episodes, full fine-tune")
        print(f"{'ranks':>5} {'s/step':>8} " + " ".join(f"{k[5:-2]:>12}" for k in SPLIT))
        with (
            LocalMesh(settings) as mesh,
            opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client,
        ):
            for n in counts:
                spec = job(model_dir, steps=args.steps, prompts=16, name=f"ranks-{n}")
                assert spec.rl is not None
                rl = spec.rl.model_copy(update={"env_options": {"num_letters": "4"}})
                spec = spec.model_copy(update={"num_devices": n, "rl": rl})
                events: list[JobEvent] = []
                done = client.fit(spec, on_event=events.append)
                steps = [e for e in events if e.kind == "step"]
                if done.state != "SUCCEEDED":
                    raise SystemExit(f"{n} ranks: job {done.state}: {done.reason}")
                figures = JobFigures(steps)
                later = steps[1:] or steps
                split = " ".join(f"{mean(s.metrics[k] for s in later):>12.3f}" for k in SPLIT)
                print(f"{n:>5} {figures.seconds_per_step:>8.3f} {split}")


if __name__ == "__main__":
    main()
