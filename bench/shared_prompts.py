"""A GRPO group's prompt computed once: sampling and training, shared vs plain, in one run.

On the demo's batch (tiny random-init Qwen2, 16 prompts x 8 samples of the letter task, 30
prompt tokens, one answer token), calls alternating between the two sides:
- sampling: ``prompt_inputs`` with each distinct prompt run once into a shared KV cache, vs
  the same call with sharing off (``share=False``), each followed by the same ``generate``;
- training: ``policy_forward`` with the batch's prompt groups vs without, each with a backward,
  and the same with gradient checkpointing on (the backward recomputes every layer);
Also the pause of one full garbage collection in this process (torch, transformers and the
model loaded) before and after ``gc.freeze()`` (services/common/heap.py).

    .venv/bin/python bench/shared_prompts.py [--calls 30]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from learn_letters_inprocess import letter_prompt  # bench/ is sys.path[0]

from opentinker.services.launcher.demo import demo_spec
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.engines.shared_prefill import prompt_inputs
from opentinker.services.trainer.model.forward import policy_forward
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.model.shared_prompts import prompt_groups
from opentinker.services.trainer.rl.batch import Episode, collate

LETTERS = "ABCDEFGH" * 2  # 16 prompts
SAMPLES = 8


def median_ms(calls: int, *sides: Callable[[], object]) -> list[float]:
    """Median ms of each side's call, the sides alternating call by call (3 warm-up rounds)."""
    times: list[list[float]] = [[] for _ in sides]
    for round_index in range(calls + 3):
        for side, call in enumerate(sides):
            started = time.perf_counter()
            call()
            if round_index >= 3:
                times[side].append((time.perf_counter() - started) * 1000)
    return [statistics.median(t) for t in times]


def sampling(engine: TransformersEngine, prompts: list[list[int]], calls: int) -> list[float]:
    def sample(share: bool) -> Callable[[], object]:
        def call() -> object:
            with torch.no_grad():
                inputs = prompt_inputs(
                    engine.model, prompts, engine.pad_token_id, engine.device, share=share
                )
                # PreTrainedModel does not declare generate: GenerationMixin's, which the
                # loaded *ForCausalLM model has
                return engine.model.generate(  # type: ignore[operator]
                    **inputs, do_sample=True, top_k=0, max_new_tokens=1, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=engine.pad_token_id,
                    eos_token_id=engine.eos_token_id,
                )  # fmt: skip

        return call

    return median_ms(calls, sample(True), sample(False))


def training(policy: Policy, episodes: list[Episode], calls: int) -> list[float]:
    batch = collate(episodes, policy.pad_id)

    def step(shared: bool) -> Callable[[], object]:
        groups = prompt_groups(episodes) if shared else None

        def call() -> object:
            policy.model.zero_grad()
            out = policy_forward(policy, batch, temperature=1.0, groups=groups)
            (out.logprobs_B_T * batch.loss_mask_B_T).sum().backward()
            return out

        return call

    return median_ms(calls, step(True), step(False))


def full_collection_ms() -> float:
    started = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30, help="calls per side (after warm-up)")
    args = parser.parse_args()
    if args.calls < 1:
        parser.error(f"--calls needs at least 1 call per side, got {args.calls}")
    model_dir = ensure_tiny_model(Path(tempfile.gettempdir()) / "opentinker-bench-tiny")
    spec = demo_spec(model_dir, threshold=0.9, max_steps=1)
    assert spec.rl is not None  # an RL job
    engine = TransformersEngine.load(spec.model, device="cpu")
    prompts = [letter_prompt(engine.tokenizer, k) for k in LETTERS for _ in range(SAMPLES)]
    completions = engine.generate(prompts, spec.rl.sampling, seed=0)
    episodes = [
        Episode(row // SAMPLES, 0, p + c.token_ids, len(p), c.logprobs, [1] * len(c.token_ids),
                float(row % 2), False)
        for row, (p, c) in enumerate(zip(prompts, completions, strict=True))
    ]  # fmt: skip
    policy = Policy(spec.model, learning_rate=1e-4)
    out = sys.stdout
    threads = torch.get_num_threads()
    out.write(f"demo batch: {len(LETTERS)} prompts x {SAMPLES} samples, "
              f"{len(prompts[0])} prompt tokens, torch threads {threads}\n")  # fmt: skip
    shared, plain = sampling(engine, prompts, args.calls)
    out.write(f"sampling (prefill + generate)  shared {shared:7.1f} ms   plain {plain:7.1f} ms"
              f"   {plain / shared:4.1f}x\n")  # fmt: skip
    shared, plain = training(policy, episodes, args.calls)
    out.write(f"training (forward + backward)  shared {shared:7.1f} ms   plain {plain:7.1f} ms"
              f"   {plain / shared:4.1f}x\n")  # fmt: skip
    del policy
    checkpointed = spec.model.model_copy(update={"gradient_checkpointing": True})
    shared, plain = training(Policy(checkpointed, learning_rate=1e-4), episodes, args.calls)
    out.write(f"  with gradient checkpointing  shared {shared:7.1f} ms   plain {plain:7.1f} ms"
              f"   {plain / shared:4.1f}x\n")  # fmt: skip
    before = statistics.median(full_collection_ms() for _ in range(3))
    tracked = len(gc.get_objects())
    gc.freeze()
    after = statistics.median(full_collection_ms() for _ in range(3))
    out.write(f"full garbage collection ({tracked:,} objects tracked)  {before:.1f} ms, "
              f"after gc.freeze() {after:.1f} ms\n")  # fmt: skip


if __name__ == "__main__":
    main()
