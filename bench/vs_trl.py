"""OpenTinker's full mesh against TRL's GRPOTrainer on the same task, in one run.

The demo task (services/launcher/demo.py: tiny random-init Qwen2, env ``letter`` with 8
letters, 16 prompts x 8 samples, lr 1e-4 constant, full fine-tuning, one token per answer,
temperature 1) trained to a 10-step mean reward of ``--target``:
- OpenTinker: the real single-node mesh (Redis, scheduler, EnvHub, worker -> trainer +
  rollout), ``max_staleness`` from ``--staleness``;
- TRL: ``GRPOTrainer`` in this process on CPU in float32, no vLLM, its default loss
  ("dapo", token-level), beta 0 (no KL, as ours), 16 prompts x 8 generations per optimizer step,
  the same lr (constant, no warmup), gradient clip 1.0 (as ours) and the letter reward
  computed from the completion text.
Seconds to target count from the start of training (model load and start-up excluded); both
print s/step and the ratio.

Needs the optional extra ``bench`` (``pip install -c .ci/constraints.txt -e '.[bench]'``: TRL,
which never replaces the pinned torch).

    .venv/bin/python bench/vs_trl.py [--target 0.9] [--max-steps 1500] [--staleness 1]
    .venv/bin/python bench/vs_trl.py --quick      # 3 steps each: the figures, not a race
"""

from __future__ import annotations

import argparse
import random
import string
import sys
import tempfile
import time
from pathlib import Path

from learn_letters_inprocess import SYSTEM, letter_reward  # bench/ is sys.path[0]
from vs_inprocess import Run, first_reaching, mesh_run

from opentinker.services.launcher.demo import demo_spec
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.spec import JobSpec


def letter_prompts(rl, alphabet: str) -> dict[str, list]:
    """The demo's prompts as TRL's conversational dataset columns (prompt, letter)."""
    rng = random.Random(rl.seed)
    letters = [rng.choice(alphabet) for _ in range(rl.steps * rl.prompts_per_step)]
    prompts = [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Answer with the letter {k}."},
        ]
        for k in letters
    ]
    return {"prompt": prompts, "letter": letters}


def grpo_config(config_cls, rl, out_dir: Path):  # noqa: ANN001, ANN201 - trl is optional
    """TRL's GRPOConfig with our job's batch, group, lr, clipping and sampling (no KL)."""
    return config_cls(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=rl.prompts_per_step * rl.samples_per_prompt,
        num_generations=rl.samples_per_prompt,
        gradient_accumulation_steps=1,
        learning_rate=rl.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        max_completion_length=rl.sampling.max_new_tokens,
        temperature=rl.sampling.temperature,
        top_p=1.0,
        top_k=0,
        max_steps=rl.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=rl.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_level="warning",
    )


def trl_run(spec: JobSpec, model_dir: Path, out_dir: Path, target: float) -> Run:
    """TRL's GRPOTrainer on the demo task until the 10-step mean reward reaches ``target``."""
    import transformers  # the bench extra: imported only here
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    assert spec.rl is not None
    rl = spec.rl
    alphabet = string.ascii_uppercase[: int(rl.env_options["num_letters"])]
    dataset = Dataset.from_dict(letter_prompts(rl, alphabet))

    def letter_rewards(completions: list, letter: list[str], **_: object) -> list[float | None]:
        return [
            letter_reward(c[0]["content"], k, alphabet, 0.0)
            for c, k in zip(completions, letter, strict=True)
        ]

    run = Run("TRL GRPOTrainer")
    rewards: list[float] = []
    train_started = [0.0]  # set when training begins

    class StopAtTarget(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            train_started[0] = time.monotonic()

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                run.steps = len(rewards)
                run.train_seconds = time.monotonic() - train_started[0]
                if first_reaching(rewards, target) is not None:
                    run.seconds_to_target = run.train_seconds
                    control.should_training_stop = True

    config = grpo_config(GRPOConfig, rl, out_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=letter_rewards,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StopAtTarget()],
    )
    trainer.remove_callback(transformers.PrinterCallback)  # a log line per step otherwise
    started = time.monotonic()
    trainer.train()
    run.wall_seconds = time.monotonic() - started
    return run


def report(ours: Run, trl: Run, target: float) -> None:
    out = sys.stdout
    out.write(f"\ndemo task to a 10-step mean reward of {target}\n")
    out.write(f"{'run':<22}{'steps':>7}{'s/step':>9}{'s to target':>13}{'wall s':>9}\n")
    for r in (ours, trl):
        to_target = (
            f"{r.seconds_to_target:.1f}" if r.seconds_to_target is not None else "not reached"
        )
        out.write(
            f"{r.name:<22}{r.steps:>7}{r.seconds_per_step:>9.4f}{to_target:>13}"
            f"{r.wall_seconds:>9.1f}\n"
        )
    if ours.seconds_per_step and trl.seconds_per_step:
        out.write(
            f"ratio {ours.name} / TRL (s/step): "
            f"{ours.seconds_per_step / trl.seconds_per_step:.2f}x\n"
        )
    if ours.seconds_to_target and trl.seconds_to_target:
        ratio = ours.seconds_to_target / trl.seconds_to_target
        out.write(f"ratio {ours.name} / TRL (seconds to target): {ratio:.2f}x\n")
    else:
        out.write(f"ratio {ours.name} / TRL (seconds to target): n/a (not reached)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--max-steps", type=int, default=1500)
    parser.add_argument("--staleness", type=int, default=1, help="the mesh's max_staleness")
    parser.add_argument("--quick", action="store_true", help="3 steps per run (a smoke test)")
    args = parser.parse_args()
    max_steps = 3 if args.quick else args.max_steps

    root = Path(tempfile.mkdtemp(prefix="opentinker-vs-trl-"))
    model_dir = ensure_tiny_model(root / "tiny-qwen2")
    spec = demo_spec(model_dir, threshold=args.target, max_steps=max_steps)
    ours = mesh_run(spec, root, args.staleness)
    trl = trl_run(spec, model_dir, root / "trl", args.target)
    report(ours, trl, args.target)


if __name__ == "__main__":
    main()
