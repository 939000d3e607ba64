"""Multi-turn generation on the transformers engine: each turn continuing the previous turn's
keys and values (``TransformersEngine.keep_prefixes``, services/rollout/engines/prefix_cache.py) vs
computing every prompt again, in one run.

``--episodes`` episodes play ``--turns`` turns: a turn samples up to ``--new-tokens`` tokens,
then the next prompt is the prompt, the completion and ``--reply-tokens`` tokens of an env's
reply (random ids). The random-init model is first nudged to end its turns with eos, as a chat
model does (a turn that ends without eos is never continued). Rounds alternate between the
two engines (each on its own copy of the same weights, the same seeds); the median round of
each is printed with the ratio, and the tokens each computed (padding included).

    .venv/bin/python bench/prefix_cache.py [--episodes 32] [--turns 6] [--rounds 6] \
        [--hidden-size 128 --layers 2] [--adapters K]

``--adapters K``: the shared multi-LoRA engine (services/rollout/engines/multi_lora.py) with K jobs'
adapters instead, episode i played by adapter i % K, every adapter keeping its prefixes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from arguments import positive_int  # bench/ is sys.path[0]
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from opentinker.services.modeling.tiny_model import ensure_scaled_model
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.engines.multi_lora import LoraRow, SharedLoraEngine
from opentinker.services.rollout.types import Completion
from opentinker.spec import LoraConfig, ModelSpec, SamplingParams


class SharedRows:
    """A shared multi-LoRA engine played as one engine: episode i by adapter i % ``adapters``."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        adapters: int,
        keep: bool,
    ) -> None:
        self.engine = SharedLoraEngine(model, tokenizer, base_model="bench")
        self.adapters = [f"job-{k}" for k in range(adapters)]
        spec = ModelSpec(base_model="bench", finetune="lora", lora=LoraConfig(rank=8))
        for adapter in self.adapters:
            self.engine.add_adapter(adapter, spec)
            if keep:
                self.engine.keep_prefixes(adapter, 1 << 30)
        self.model, self.tokenizer = model, tokenizer
        self.eos_token_id = self.engine.eos_token_id

    @property
    def prefixes(self):  # noqa: ANN201
        return self.engine.prefixes

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        rows = [
            LoraRow(p, self.adapters[i % len(self.adapters)], sampling, seed * 1000 + i)
            for i, p in enumerate(prompts)
        ]
        return self.engine.generate_rows(rows)


def engines(
    args: argparse.Namespace, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> tuple[TransformersEngine, TransformersEngine] | tuple[SharedRows, SharedRows]:
    """(plain, continued) engines, each on its own copy of ``model``."""
    if args.adapters:
        return (
            SharedRows(copy.deepcopy(model), tokenizer, args.adapters, keep=False),
            SharedRows(copy.deepcopy(model), tokenizer, args.adapters, keep=True),
        )
    plain = TransformersEngine(copy.deepcopy(model), tokenizer)
    continued = TransformersEngine(copy.deepcopy(model), tokenizer)
    continued.keep_prefixes(1 << 30)
    return plain, continued


def eos_nudged(model_dir: Path, steps: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    ids_B_T = torch.randint(0, len(tokenizer), (8, 64))
    for _ in range(steps):
        logp_B_T = torch.log_softmax(model(input_ids=ids_B_T).logits, -1)
        (-logp_B_T[..., tokenizer.eos_token_id].mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), tokenizer


def one_round(engine: TransformersEngine | SharedRows, args: argparse.Namespace, seed: int) -> dict:
    """Seconds for every turn of every episode, tokens computed, turns ended with eos."""
    generator = torch.Generator().manual_seed(seed)
    vocab = len(engine.tokenizer)
    prompts_B_T = torch.randint(0, vocab, (args.episodes, args.prompt_tokens), generator=generator)
    prompts: list[list[int]] = prompts_B_T.tolist()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
    fed = [0]
    hook = engine.model.register_forward_pre_hook(
        lambda _m, _a, kw: fed.__setitem__(0, fed[0] + kw["input_ids"].numel()), with_kwargs=True
    )
    ended = 0
    started = time.perf_counter()
    for turn in range(args.turns):
        completions = engine.generate(prompts, sampling, seed=seed * 100 + turn)
        ended += sum(c.token_ids[-1:] == [engine.eos_token_id] for c in completions)
        replies = torch.randint(0, vocab, (args.episodes, args.reply_tokens), generator=generator)
        prompts = [
            p + c.token_ids + r
            for p, c, r in zip(prompts, completions, replies.tolist(), strict=True)
        ]
    seconds = time.perf_counter() - started
    hook.remove()
    if engine.prefixes is not None:
        engine.prefixes.clear()  # the next round starts as the plain one does
    return {"seconds": seconds, "tokens": fed[0], "ended": ended, "last_prompt": len(prompts[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=positive_int, default=32)
    parser.add_argument("--turns", type=positive_int, default=6)
    parser.add_argument("--prompt-tokens", type=positive_int, default=60)
    parser.add_argument("--reply-tokens", type=positive_int, default=40)
    parser.add_argument("--new-tokens", type=positive_int, default=16)
    parser.add_argument("--rounds", type=positive_int, default=6)
    parser.add_argument("--nudge-steps", type=int, default=3, help="Adam steps towards eos")
    parser.add_argument("--hidden-size", type=positive_int, default=128)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--adapters", type=int, default=0, help="K > 0: a shared LoRA engine")
    args = parser.parse_args()
    if args.adapters < 0:
        parser.error(f"--adapters needs 0 (a private engine) or more, got {args.adapters}")

    root = Path(tempfile.mkdtemp(prefix="opentinker-prefix-cache-"))
    model_dir = ensure_scaled_model(
        root / "qwen2", hidden_size=args.hidden_size, num_layers=args.layers
    )
    model, tokenizer = eos_nudged(model_dir, args.nudge_steps)
    plain, continued = engines(args, model, tokenizer)
    one_round(plain, args, seed=0)  # warm-up, both
    one_round(continued, args, seed=0)
    results: dict[str, list[dict]] = {"every prompt again": [], "continued": []}
    for index in range(args.rounds):
        results["every prompt again"].append(one_round(plain, args, seed=index + 1))
        results["continued"].append(one_round(continued, args, seed=index + 1))
    out = sys.stdout
    out.write(
        f"{args.episodes} episodes x {args.turns} turns (prompt {args.prompt_tokens}, up to "
        f"{args.new_tokens} new, reply {args.reply_tokens} tokens a turn), hidden "
        f"{args.hidden_size}, {args.layers} layers, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds"
        + (f", a shared engine with {args.adapters} LoRA adapters\n" if args.adapters else "\n")
    )
    turns_total = args.episodes * args.turns
    median = {}
    for name, rounds in results.items():
        median[name] = statistics.median(r["seconds"] for r in rounds)
        tokens = statistics.median(r["tokens"] for r in rounds)
        ended = statistics.median(r["ended"] for r in rounds) / turns_total
        last = statistics.median(r["last_prompt"] for r in rounds)
        out.write(
            f"{name:<20} {median[name]:.3f} s   {tokens:,.0f} tokens computed   "
            f"turns ended with eos {ended:.0%}   last prompt {last:.0f} tokens\n"
        )
    ratio = median["every prompt again"] / median["continued"]
    out.write(f"continued is {ratio:.2f}x as fast\n")


if __name__ == "__main__":
    main()
