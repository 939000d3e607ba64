"""TRL's GRPOTrainer on the real-model job of bench/real_model.py (the ``bench`` extra).

The same prompts in the same order (no shuffling), the game's own reward, the job's batch,
group, LoRA (``peft_lora_config``), lr, temperature and max new tokens; validation with greedy
``generate`` on the job's validation episodes before training and every ``val_every`` steps,
its time left out of the training clock. The split of a step: ``generate`` is TRL's
``_generate_and_score_completions`` less the reward calls, ``env`` the reward calls, ``train``
the rest of the step.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import transformers
from datasets import Dataset
from real_model_common import Point, Side, mean_split, training_problems, validation_problems
from trl import GRPOConfig, GRPOTrainer
from vs_trl import grpo_config

from opentinker.eval_stats import wilson
from opentinker.services.envhub.games.arithmetic_env import ArithmeticGame
from opentinker.services.modeling.adapters import peft_lora_config
from opentinker.spec import JobSpec


class TrlRun:
    def __init__(self, spec: JobSpec, model_dir: Path, out_dir: Path, budget_s: float) -> None:
        assert spec.rl is not None
        self.spec, self.rl, self.model_dir, self.out_dir = spec, spec.rl, model_dir, out_dir
        self.budget_s = budget_s
        self.game = ArithmeticGame()
        self.side = Side("TRL GRPOTrainer")
        self.timers = {"generate": 0.0, "env": 0.0}
        self.steps: list[dict[str, float]] = []

    def reward(self, completions: list, env_seed: list[int], **_: object) -> list[float | None]:
        started = time.monotonic()
        rewards: list[float | None] = []
        for completion, seed in zip(completions, env_seed, strict=True):
            self.game.reset(seed=seed, **self.rl.env_options)
            rewards.append(self.game.step(completion[0]["content"]).reward)
        self.timers["env"] += time.monotonic() - started
        return rewards

    def config(self) -> GRPOConfig:
        """vs_trl's config of our job (batch, group, lr, clip, sampling, no KL), the prompts
        kept in the rollout's order."""
        config = grpo_config(GRPOConfig, self.rl, self.out_dir)
        config.shuffle_dataset = False
        # TRL's default is True; the job's (model.gradient_checkpointing) is False. With it on,
        # TRL also turns the model's KV cache off, and generate() then recomputes every prefix.
        config.gradient_checkpointing = self.spec.model.gradient_checkpointing
        return config

    def dataset(self) -> Dataset:
        system = self.game.get_system_prompt()
        problems = training_problems(self.rl, steps=self.rl.steps)
        return Dataset.from_dict(
            {
                "prompt": [
                    [{"role": "system", "content": system}, {"role": "user", "content": text}]
                    for _, text in problems
                ],
                "env_seed": [seed for seed, _ in problems],
            }
        )

    def validate(self, model, tokenizer) -> float:  # noqa: ANN001 - a peft model
        """Greedy accuracy on the job's validation episodes (batches of 16, left-padded)."""
        system, options = (
            self.game.get_system_prompt(),
            {**self.rl.env_options, **self.rl.val_env_options},
        )
        problems = validation_problems(self.rl)
        tokenizer.padding_side = "left"
        right = 0
        model.eval()
        for i in range(0, len(problems), 16):
            chunk = problems[i : i + 16]
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "system", "content": system}, {"role": "user", "content": t}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                for _, t in chunk
            ]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(
                    **batch,
                    max_new_tokens=self.rl.sampling.max_new_tokens,
                    do_sample=False,
                    use_cache=True,  # whatever the training config left in model.config
                    pad_token_id=tokenizer.pad_token_id,
                )
            replies = tokenizer.batch_decode(
                out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
            )
            for (seed, _), reply in zip(chunk, replies, strict=True):
                self.game.reset(seed=seed, **options)
                right += self.game.step(reply).reward > 0
        model.train()
        return right / len(problems)

    def run(self) -> Side:
        started = time.monotonic()
        side, run = self.side, self
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.model_dir))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(self.model_dir))
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=self.reward,
            args=self.config(),
            train_dataset=self.dataset(),
            processing_class=tokenizer,
            peft_config=peft_lora_config(self.spec.model.lora),
        )
        generate_and_score = trainer._generate_and_score_completions

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            begun, env_before = time.monotonic(), run.timers["env"]
            out = generate_and_score(*args, **kwargs)
            spent = time.monotonic() - begun - (run.timers["env"] - env_before)
            run.timers["generate"] += spent
            return out

        trainer._generate_and_score_completions = timed  # type: ignore[method-assign]
        clock = {"start": 0.0, "step_start": 0.0, "validating": 0.0}

        class Track(transformers.TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN201
                side.before = wilson(
                    round(run.validate(trainer.model, tokenizer) * run.rl.val_episodes),
                    run.rl.val_episodes,
                )
                clock["start"] = time.monotonic()

            def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN201
                clock["step_start"] = time.monotonic()
                run.timers.update(generate=0.0, env=0.0)

            def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN201
                now = time.monotonic()
                step_s = now - clock["step_start"]
                g, e = run.timers["generate"], run.timers["env"]
                run.steps.append(
                    {"time_generate_s": g, "time_env_s": e, "time_train_s": step_s - g - e,
                     "time_step_s": step_s}
                )  # fmt: skip
                seconds = now - clock["start"] - clock["validating"]
                point = Point(seconds, state.global_step, float("nan"))
                if state.global_step % run.rl.val_every == 0:
                    v0 = time.monotonic()
                    point.val_accuracy = run.validate(trainer.model, tokenizer)
                    clock["validating"] += time.monotonic() - v0
                    if seconds >= run.budget_s:
                        control.should_training_stop = True
                side.points.append(point)

            def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001, ANN201
                if logs and "reward" in logs and side.points:
                    side.points[-1].reward = float(logs["reward"])

        trainer.add_callback(Track())
        trainer.remove_callback(transformers.PrinterCallback)
        trainer.train()
        side.split = mean_split(self.steps)
        side.wall_seconds = time.monotonic() - started
        return side
