"""The vLLM engine on a GPU: rollout tokens/s against vLLM's own offline ``LLM.generate`` on
the same prompts, and the seconds of a weight sync (apply + probe), LoRA and full.

Needs a CUDA GPU and the ``vllm`` extra (bench/gpu_check.sh installs it on a lent machine).
The model is Qwen2.5-0.5B-shaped with random init, built here (nothing downloads).

    python bench/vllm_engine.py [--prompts 256] [--max-new-tokens 128] [--eager]

Rows (each the median of ``--repeats`` runs): ``engine.generate`` (what the rollout calls:
the sampled token's logprob, stop at eos), then with a seed per request
(``OPENTINKER_ROLLOUT_VLLM_SEED_PER_REQUEST=true``, the only way before 2026-11-26), and
``LLM.generate`` (vLLM alone: one SamplingParams, no logprobs, no seeds; token ids only, as
the rollout asks), then vLLM alone with the logprob, and with a seed per request: what each
costs. ``transformers`` (the
engine the rollout uses without vLLM) for scale. On an H100 (2026-11-26, one run each) the
engine, a seed per request then, made 30.0k tokens/s against vLLM alone's 40.2k (0.75x).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from opentinker.services.modeling.tiny_model import QWEN2_5_0_5B_SHAPE, build_tiny_model
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.engines.vllm_engine import VllmEngine
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.spec import LoraConfig, ModelSpec, SamplingParams


def chat_prompts(engine: VllmEngine, n: int) -> list[list[int]]:
    return [
        user_turn_ids(engine, f"Answer with the letter {chr(65 + i % 26)}. " * (1 + i % 4))
        for i in range(n)
    ]


def user_turn_ids(engine: VllmEngine, content: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)  # tokenized: the ids (the declared type is every mode's result)


def timed(fn):  # noqa: ANN001, ANN201 - any call
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - started


def median_timed(fn, repeats: int):  # noqa: ANN001, ANN201 - any call
    """The last call's result and the median seconds of ``repeats`` calls."""
    runs = [timed(fn) for _ in range(repeats)]
    return runs[-1][0], statistics.median(seconds for _, seconds in runs)


def throughput(
    engine: VllmEngine, prompts: list[list[int]], new_tokens: int, repeats: int
) -> list[tuple]:
    """engine.generate, then LLM.generate plain and with each of what the engine adds (the
    sampled token's logprob; a seed per request), to split any gap between the first two."""
    import vllm

    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens)
    engine.generate(prompts[:8], sampling, seed=0)  # warm-up
    ours, ours_s = median_timed(lambda: engine.generate(prompts, sampling, seed=1), repeats)
    rows = [("engine.generate (rollout)", sum(len(c.token_ids) for c in ours), ours_s)]
    engine.seed_per_request = True  # OPENTINKER_ROLLOUT_VLLM_SEED_PER_REQUEST=true
    seeded, seeded_s = median_timed(lambda: engine.generate(prompts, sampling, seed=1), repeats)
    engine.seed_per_request = False
    rows.append(("  seed per request", sum(len(c.token_ids) for c in seeded), seeded_s))
    # Token ids out, as the rollout asks (detokenize=False): text would cost vLLM per-token CPU
    # work the engine never does, and the random model's ids past the 512-token tokenizer
    # (vocab 151936) decode to nothing anyway.
    plain = {"temperature": 1.0, "max_tokens": new_tokens, "detokenize": False}
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    variants = {
        "LLM.generate (vLLM alone)": [vllm.SamplingParams(**plain)] * len(prompts),
        "  + sampled logprob": [vllm.SamplingParams(**plain, logprobs=0)] * len(prompts),
        "  + a seed per request": [
            vllm.SamplingParams(**plain, seed=i) for i in range(len(prompts))
        ],
    }
    for name, params in variants.items():
        out, seconds = median_timed(
            lambda params=params: engine.llm.generate(token_prompts, params, use_tqdm=False),
            repeats,
        )
        rows.append((name, sum(len(r.outputs[0].token_ids) for r in out), seconds))
    return rows


def transformers_throughput(spec: ModelSpec, prompts: list[list[int]], new_tokens: int) -> tuple:
    engine = TransformersEngine.load(spec, device="cuda:0", max_batch_size=64)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    engine.generate(prompts[:8], sampling, seed=0)
    out, seconds = timed(lambda: engine.generate(prompts, sampling, seed=1))
    return ("transformers engine (bf16)", sum(len(c.token_ids) for c in out), seconds)


def sync_seconds(engine: VllmEngine, tensors: dict[str, torch.Tensor], probe: list[int]) -> tuple:
    _, apply_s = timed(lambda: engine.apply_weights(tensors, engine.policy_version + 1))
    _, probe_s = timed(lambda: engine.logprobs_of(probe))
    return apply_s, probe_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (faster start)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row (median)")
    parser.add_argument("--model", type=Path, help="a model folder (default: build one)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/vllm_engine.py needs a CUDA GPU")
    model = args.model or build_tiny_model(
        Path(tempfile.mkdtemp(prefix="qwen0.5b-")), **QWEN2_5_0_5B_SHAPE
    )
    settings = RolloutSettings(gpu_memory_utilization=0.4, vllm_enforce_eager=args.eager)
    out = sys.stdout
    full = ModelSpec(base_model=str(model), finetune="full")
    engine = VllmEngine.load(full, settings)
    prompts = chat_prompts(engine, args.prompts)
    rows = throughput(engine, prompts, args.max_new_tokens, args.repeats)
    probe = prompts[0] + list(range(100, 164))
    cpu_model = TransformersEngine.load(full, device="cpu").model  # what a trainer sends
    state = {n: p.detach().to(torch.bfloat16) for n, p in cpu_model.named_parameters()}
    full_sync = sync_seconds(engine, state, probe)
    engine.close()
    rows.append(transformers_throughput(full, prompts, args.max_new_tokens))

    lora = ModelSpec(base_model=str(model), finetune="lora", lora=LoraConfig(rank=16, alpha=32))
    # Eager: the sync does not depend on CUDA graphs, and this saves a compile.
    lora_engine = VllmEngine.load(lora, settings.model_copy(update={"vllm_enforce_eager": True}))
    adapter = {n: torch.randn(s) * 0.02 for n, s in lora_engine.shapes.shapes.items()}
    lora_sync = sync_seconds(lora_engine, adapter, probe)
    lora_engine.close()

    out.write(
        f"{args.prompts} prompts x {args.max_new_tokens} new tokens, Qwen2.5-0.5B shape, bf16, "
        f"{torch.cuda.get_device_name(0)}, {'eager' if args.eager else 'CUDA graphs'}\n"
    )
    base = rows[2][1] / rows[2][2]  # LLM.generate (vLLM alone)
    out.write(f"{'generation':<30}{'tokens':>9}{'seconds':>9}{'tokens/s':>11}{'vs vLLM':>9}\n")
    for name, tokens, seconds in rows:
        rate = tokens / seconds
        out.write(f"{name:<30}{tokens:>9}{seconds:>9.2f}{rate:>11.0f}{rate / base:>8.2f}x\n")
    out.write(f"{'weight sync':<30}{'tensors':>9}{'apply s':>9}{'probe s':>11}\n")
    out.write(f"{'full (494M, bf16 from CPU)':<30}{len(state):>9}{full_sync[0]:>9.3f}")
    out.write(f"{full_sync[1]:>11.3f}\n")
    out.write(f"{'LoRA r16 q/k/v/o (new folder)':<30}{len(adapter):>9}{lora_sync[0]:>9.3f}")
    out.write(f"{lora_sync[1]:>11.3f}\n")


if __name__ == "__main__":
    main()
