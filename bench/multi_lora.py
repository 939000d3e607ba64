"""Rollout tokens/s of k LoRA jobs: one shared engine (every job's adapter in one mixed-adapter
call) against k separate engines, on CPU with the tiny local model.

  shared:   one SharedLoraEngine holding k adapters behind the MixedBatcher; k threads (one per
            job, as k trainers' streams would) call their AdapterEngine.generate at once, and
            the batcher merges what arrives into one engine call.
  separate: k TransformersEngine objects in this one process (k copies of the base model, each
            wrapped with its own LoRA), called from k threads at once: what k private rollouts
            on one node do, minus the process boundaries.

With ``--engine vllm`` (a CUDA GPU and the vllm extra; ``--model`` a local model folder) the
shared side is vLLM's multi-LoRA (``VllmMixedLoraEngine``, one ``LLM.generate`` holding every
job's rows, one ``LoRARequest`` per row) and the other side is the same engine taking one job's
call at a time (what k private engines time-sharing one GPU do, without k copies of the base);
token budgets there end at eos as in a job.

Each job generates ``--prompts`` completions of ``--new-tokens`` tokens per round (a fixed
token budget: eos is never sampled, so both sides generate the same number of tokens),
``--rounds`` rounds after one warm-up round; the rounds alternate between the two sides so
that both see the same load on a shared machine. Adapters get random non-zero weights (they
differ, as trained ones do). Printed: tokens/s of each side, their ratio, and the base-model
bytes each side holds.

    .venv/bin/python bench/multi_lora.py [--ks 1,4,16] [--prompts 8] [--new-tokens 16]
    python bench/multi_lora.py --engine vllm --model DIR [--ks 1,4,16]   # on a GPU
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.agent.seeds import derive_seed
from opentinker.services.rollout.engines.engine import GenerationEngine, TransformersEngine
from opentinker.services.rollout.engines.multi_lora import (
    LoraRow,
    MixedLoraEngine,
    SharedLoraEngine,
)
from opentinker.services.rollout.engines.vllm_adapters import WeightShapes
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.rollout.shared.batcher import MixedBatcher
from opentinker.services.rollout.shared.shared_engine import SharedAdapters
from opentinker.services.rollout.types import Completion
from opentinker.spec import LoraConfig, ModelSpec, SamplingParams


class Generates(Protocol):
    """What a side's job calls: a GenerationEngine, or OneJobPerCall (vLLM's other side)."""

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]: ...


def randomize_adapters(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)


def one_round(
    engines: Sequence[Generates],
    prompts: list[list[int]],
    sampling: SamplingParams,
    round_index: int,
) -> tuple[int, float]:
    """Every job generates at once (a thread each); (tokens generated, seconds)."""
    tokens = [0] * len(engines)

    def job(i: int) -> None:
        out = engines[i].generate(prompts, sampling, seed=1000 * round_index + i)
        tokens[i] = sum(len(c.token_ids) for c in out)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(len(engines))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens), time.perf_counter() - started


def compare(
    sides: Sequence[Sequence[Generates]],
    prompts: list[list[int]],
    sampling: SamplingParams,
    rounds: int,
    *,
    warm_up: Sequence[bool] | None = None,
) -> list[float]:
    """Tokens/s of each side; rounds alternate between the sides (after one warm-up round
    of each side whose ``warm_up`` is true, every side by default), so both see the same load
    on a shared machine."""
    for side, warm in zip(sides, warm_up or [True] * len(sides), strict=True):
        if warm:
            one_round(side, prompts, sampling, -1)
    totals = [[0, 0.0] for _ in sides]
    for r in range(rounds):
        for side, total in zip(sides, totals, strict=True):
            tokens, seconds = one_round(side, prompts, sampling, r)
            total[0] += tokens
            total[1] += seconds
    return [tokens / seconds for tokens, seconds in totals]


def shared_side(model_dir: Path, k: int, spec: ModelSpec) -> tuple[list[GenerationEngine], int]:
    engine = SharedLoraEngine.load(str(model_dir), device="cpu", max_batch_size=1024)
    shared = SharedAdapters(MixedBatcher(engine), capacity=k)
    views: list[GenerationEngine] = [shared.attach(f"job-{i}", spec) for i in range(k)]
    assert engine.model is not None
    randomize_adapters(engine.model)
    no_eos(engine)
    return views, base_bytes(engine.base)


def separate_side(model_dir: Path, k: int, spec: ModelSpec) -> tuple[list[TransformersEngine], int]:
    engines: list[TransformersEngine] = []
    for _ in range(k):
        engine = TransformersEngine.load(spec, device="cpu", max_batch_size=1024)
        randomize_adapters(engine.model)
        no_eos(engine)
        engines.append(engine)
    return engines, k * base_bytes(engines[0].model)


def no_eos(engine: TransformersEngine | SharedLoraEngine) -> None:
    """A fixed token budget: an eos id outside the vocabulary is never sampled."""
    engine.eos_token_id = 10**9


def base_bytes(model: torch.nn.Module) -> int:
    """Bytes of the base weights (every parameter but the adapters')."""
    return sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n
    )


class OneJobPerCall:
    """A job's view of a shared engine whose calls never merge: each holds one job's rows
    (under a lock), as k private engines taking turns on one GPU would run."""

    def __init__(self, engine: MixedLoraEngine, adapter: str, lock: threading.Lock) -> None:
        self.engine, self.adapter, self.lock = engine, adapter, lock

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        rows = [
            LoraRow(p, self.adapter, sampling, derive_seed(seed, "row", i))
            for i, p in enumerate(prompts)
        ]
        with self.lock:
            return self.engine.generate_rows(rows)


def vllm_main(args: argparse.Namespace, ks: list[int]) -> None:
    """Shared (merged calls) against one job per call, both on one vLLM multi-LoRA engine."""
    from opentinker.services.rollout.engines.engine_choice import vllm_installed
    from opentinker.services.rollout.engines.vllm_multi_lora import VllmMixedLoraEngine

    if not torch.cuda.is_available() or not vllm_installed():
        raise SystemExit(
            "--engine vllm needs a CUDA GPU and the vllm extra (here: "
            f"cuda={torch.cuda.is_available()}, vllm={vllm_installed()}); "
            "bench/gpu_check.sh multilora runs it on a GPU machine"
        )
    if not args.model:
        raise SystemExit("--engine vllm needs --model (a local model folder)")
    spec = ModelSpec(base_model=args.model, finetune="lora", lora=LoraConfig(rank=8))
    settings = RolloutSettings(
        gpu_memory_utilization=args.gpu_memory_utilization, vllm_enforce_eager=args.eager
    )
    engine = VllmMixedLoraEngine.load(args.model, settings, capacity=max(ks), max_lora_rank=8)
    shapes = WeightShapes.of(spec).shapes
    prompts = [
        engine.tokenizer.encode(f"question number {i}: what comes next?")
        for i in range(args.prompts)
    ]
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens)
    print(
        f"vLLM multi-LoRA on {torch.cuda.get_device_name(0)}, {args.model}, LoRA rank 8; per "
        f"job and round: {args.prompts} completions x up to {args.new_tokens} tokens; "
        f"{args.rounds} rounds"
    )
    print(f"{'k':>3} {'merged tok/s':>13} {'one job/call tok/s':>19} {'merged/one':>11}")
    for k in ks:
        shared = SharedAdapters(MixedBatcher(engine), capacity=k)
        lock = threading.Lock()
        merged: list[Generates] = []
        turns: list[Generates] = []
        for i in range(k):
            view = shared.attach(f"job-{i}", spec)
            generator = torch.Generator().manual_seed(i)
            engine.apply_adapter_weights(
                view.adapter,
                {n: 0.05 * torch.randn(shape, generator=generator) for n, shape in shapes.items()},
            )
            merged.append(view)
            turns.append(OneJobPerCall(engine, view.adapter, lock))
        # One job per call runs the same kernels at every k (one adapter, the same rows), so
        # only the first k warms it up: at k=16 its warm-up round alone is 16 calls in a row,
        # a minute of a short GPU lease (an H100, eager: about 67 ms a decode step)
        merged_tps, turns_tps = compare(
            [merged, turns], prompts, sampling, args.rounds, warm_up=[True, k == ks[0]]
        )
        print(f"{k:>3} {merged_tps:>13.0f} {turns_tps:>19.0f} {merged_tps / turns_tps:>10.2f}x")
        for i in range(k):
            shared.detach(f"job-{i}")
    engine.close()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ks", default="1,4,16", help="numbers of jobs (adapters)")
    parser.add_argument("--prompts", type=int, default=8, help="completions per job per round")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens per completion")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per engine call (each of the separate side's k calls runs in its "
        "own thread at once, so that side may use k cores; the shared side's one call uses "
        "these); 1 by default: spinning OpenMP teams on a loaded 2-core machine made "
        "2-thread calls 10-100x slower",
    )
    parser.add_argument(
        "--engine",
        choices=("transformers", "vllm"),
        default="transformers",
        help="transformers: peft on CPU vs k separate engines; vllm: vLLM multi-LoRA on a GPU",
    )
    parser.add_argument("--model", default="", help="(vllm) a local model folder")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.3, help="(vllm) vLLM's share of the GPU"
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="(vllm) no CUDA graphs: starts without capturing a graph per LoRA batch shape, "
        "which costs minutes of a short GPU lease; decodes slower",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    if args.engine == "vllm":
        vllm_main(args, ks)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        spec = ModelSpec(base_model=str(model_dir), finetune="lora", lora=LoraConfig(rank=8))
        tokenizer = SharedLoraEngine.load(str(model_dir)).tokenizer
        prompts = [
            tokenizer.encode(f"question number {i}: what comes next?") for i in range(args.prompts)
        ]
        sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens)
        print(
            f"tiny Qwen2 (CPU, fp32, {torch.get_num_threads()} threads), LoRA rank 8; per job "
            f"and round: {args.prompts} completions x {args.new_tokens} tokens; "
            f"{args.rounds} rounds"
        )
        print(
            f"{'k':>3} {'shared tok/s':>13} {'separate tok/s':>15} {'shared/separate':>16}", end=""
        )
        print(f" {'base MiB shared':>16} {'separate':>9}")
        for k in ks:
            shared, shared_held = shared_side(model_dir, k, spec)
            separate, separate_held = separate_side(model_dir, k, spec)
            shared_tps, separate_tps = compare([shared, separate], prompts, sampling, args.rounds)
            print(
                f"{k:>3} {shared_tps:>13.0f} {separate_tps:>15.0f} "
                f"{shared_tps / separate_tps:>15.2f}x "
                f"{shared_held / 2**20:>16.1f} {separate_held / 2**20:>9.1f}"
            )


if __name__ == "__main__":
    main()
