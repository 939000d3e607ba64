"""Peak memory of one training forward+backward: full logits vs chunked logprobs + micro-batches.

The model: a random-init Qwen2 with Qwen2.5's real vocabulary (151,936 tokens) and otherwise
small dims (2 layers, hidden 256), LoRA on q/k/v/o as the trainer's default, built here (no
download, no tokenizer: random token ids). The loss: GRPO-like, minus the masked token mean of
advantage x logprob, advantages +-1 per sequence, the first quarter of each row a prompt.

  old: the model's own forward to logits [B, L, V], one float32 log_softmax over all of them
       (the trainer's path before logprobs.py), one backward.
  new: the batch cut into micro-batches of at most --budget padded tokens (microbatch.py),
       each through the chunked logprobs (logprobs.py), gradients accumulated.

Each (configuration, path) runs in a fresh subprocess, after a small warm-up step there, so
one measurement's leftovers never count in another. Peak: on CUDA, max_memory_allocated above
what was allocated before the step; on CPU, the growth of the resident set's high-water mark
(VmHWM, reset through /proc/self/clear_refs right before the step) over the resident size at
that moment: what the OS actually had to give, torch's allocations and everything else.

    .venv/bin/python bench/trainer_memory.py [--quick] [--budget 1024] [--device cpu]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import time
from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from opentinker.services.trainer.model.logprobs import (
    chunk_positions_for,
    token_logprobs_and_entropy,
    unchunked_token_logprobs_and_entropy,
)
from opentinker.services.trainer.model.microbatch import MicroBatch, loss_tokens, micro_batches
from opentinker.services.trainer.rl.batch import Episode, collate

VOCAB = 151_936  # Qwen2.5's
PAD_ID = 0
FULL = [(1, 256), (2, 256), (4, 256), (8, 256), (16, 256), (32, 256), (2, 1024), (8, 1024)]
QUICK = [(2, 32), (16, 32)]
FULL_BUDGET, QUICK_BUDGET = 1024, 128  # padded tokens per micro-batch
QUICK_CHUNK = 64  # positions per logits chunk in --quick (the default is the library's)


def build_model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return get_peft_model(Qwen2ForCausalLM(config), lora).to(device).train()


def random_episodes(batch: int, seq_len: int, seed: int = 0) -> list[Episode]:
    gen = torch.Generator().manual_seed(seed)
    prompt = seq_len // 4
    out = []
    for b in range(batch):
        ids = torch.randint(1, VOCAB, (seq_len,), generator=gen).tolist()
        n = seq_len - prompt
        out.append(Episode(b, 0, ids, prompt, [0.0] * n, [1] * n, float(b % 2), False))
    return out


def advantages_of(episodes: list[Episode]) -> torch.Tensor:
    return torch.tensor([1.0 if e.reward > 0 else -1.0 for e in episodes])


def old_step(model: torch.nn.Module, episodes: list[Episode], device: torch.device) -> None:
    batch = collate(episodes, PAD_ID)
    logprobs_B_T, _ = unchunked_token_logprobs_and_entropy(
        model, batch.tokens_B_L.to(device), batch.attention_mask_B_L.to(device)
    )
    mask_B_T = batch.loss_mask_B_T.to(device)
    weights_B_1 = advantages_of(episodes).to(device)[:, None]
    (-(logprobs_B_T * weights_B_1 * mask_B_T).sum() / mask_B_T.sum()).backward()


def new_step(
    model: torch.nn.Module, episodes: list[Episode], device: torch.device, budget: int, chunk: int
) -> None:
    parts: list[MicroBatch] = micro_batches(episodes, PAD_ID, budget)
    total = loss_tokens(parts)
    advantages = advantages_of(episodes)
    for part in parts:
        logprobs_B_T, _ = token_logprobs_and_entropy(
            model,
            part.batch.tokens_B_L.to(device),
            part.batch.attention_mask_B_L.to(device),
            chunk_positions=chunk,
        )
        mask_B_T = part.batch.loss_mask_B_T.to(device)
        weights_B_1 = advantages[part.indices].to(device)[:, None]
        (-(logprobs_B_T * weights_B_1 * mask_B_T).sum() / total).backward()


def measure(path: str, batch: int, seq_len: int, budget: int, device_name: str, chunk: int) -> dict:
    """Run one step in this process; its peak memory growth (MiB) and seconds."""
    device = torch.device(device_name)
    model = build_model(device)

    def run(episodes: list[Episode]) -> None:
        if path == "old":
            old_step(model, episodes, device)
        else:
            new_step(model, episodes, device, budget, chunk)

    run(random_episodes(2, 16, seed=1))  # warm-up: allocator, thread pools, autograd engine
    model.zero_grad(set_to_none=True)
    episodes = random_episodes(batch, seq_len)
    return peak_growth(lambda: run(episodes), device)


def peak_growth(step: Callable[[], object], device: torch.device) -> dict:
    """Run ``step``; the growth of peak memory over what was in use before it (MiB), and its
    seconds. CUDA: max_memory_allocated over memory_allocated. CPU: the resident set's
    high-water mark (VmHWM, reset through /proc/self/clear_refs right before) over VmRSS."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
        before = status_kib("VmRSS") * 1024
    started = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = status_kib("VmHWM") * 1024
    return {"peak_mib": (peak - before) / 2**20, "seconds": time.perf_counter() - started}


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure_into(conn, measure_fn: Callable[..., dict], *args) -> None:
    try:
        conn.send(measure_fn(*args))
    except Exception as err:  # noqa: BLE001 - reported in the table (e.g. out of memory)
        conn.send({"error": f"{type(err).__name__}: {err}"[:60]})


def in_fresh_process(measure_fn: Callable[..., dict], *args, spawn: bool = False) -> dict:
    """``measure_fn(*args)`` in a new process: forked (fast, and its heap starts empty), or
    spawned for CUDA (a CUDA context never crosses a fork)."""
    ctx = mp.get_context("spawn") if spawn else mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=_measure_into, args=(send, measure_fn, *args))
    worker.start()
    result = receive.recv() if receive.poll(900) else {"error": "timed out"}
    worker.join(timeout=60)
    if worker.exitcode not in (0, None) and "error" not in result:
        result = {"error": f"exit {worker.exitcode}"}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="two small configurations (the smoke test)"
    )
    parser.add_argument("--budget", type=int, help="padded tokens per micro-batch")
    parser.add_argument("--chunk", type=int, help="positions per logits chunk")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--max-old-tokens", type=int, default=2048, help="skip the old path above B*L tokens"
    )
    args = parser.parse_args()
    configs = QUICK if args.quick else FULL
    args.budget = args.budget or (QUICK_BUDGET if args.quick else FULL_BUDGET)
    args.chunk = args.chunk or (QUICK_CHUNK if args.quick else chunk_positions_for(VOCAB))
    print(
        f"device {args.device}; vocab {VOCAB}; micro-batch budget {args.budget} tokens; "
        f"logits chunk {args.chunk} positions"
    )
    print(f"{'batch':>5} {'seq':>5} {'old MiB':>9} {'new MiB':>9} {'ratio':>7} ", end="")
    print(f"{'old s':>7} {'new s':>7}")
    for batch, seq_len in configs:
        sizes = (batch, seq_len, args.budget, args.device, args.chunk)
        spawn = args.device.startswith("cuda")
        if batch * seq_len <= args.max_old_tokens:
            old = in_fresh_process(measure, "old", *sizes, spawn=spawn)
        else:
            old = {"error": "skipped"}
        new = in_fresh_process(measure, "new", *sizes, spawn=spawn)
        print(_row(batch, seq_len, old, new), flush=True)


def _row(batch: int, seq_len: int, old: dict, new: dict) -> str:
    def mib(r: dict) -> str:
        return f"{r['peak_mib']:9.0f}" if "peak_mib" in r else f"{r['error'][:9]:>9}"

    def secs(r: dict) -> str:
        return f"{r['seconds']:7.2f}" if "seconds" in r else f"{'-':>7}"

    ratio = (
        f"{old['peak_mib'] / new['peak_mib']:6.1f}x"
        if "peak_mib" in old and "peak_mib" in new and new["peak_mib"] > 0
        else f"{'-':>7}"
    )
    return f"{batch:5d} {seq_len:5d} {mib(old)} {mib(new)} {ratio} {secs(old)} {secs(new)}"


if __name__ == "__main__":
    main()
