"""Time-sliced LoRA training: k tenants' sessions on one shared base in one trainer process
(services/trainer/session/host.py) against k sessions each in a process of its own (today's
one-trainer-per-session, each with its own copy of the base).

Every session is a real ``TrainingSession``: ``forward_backward`` on a batch of
``--batch`` x ``--length`` tokens (cross-entropy), then ``optim_step``, ``--steps`` times.
Ranks are mixed (4, 8, 16, 32 in turn; every other session also trains the MLP). Shared: one
process holds a ``SharedLoraHost`` and all k sessions, whose calls run in fair turns. Separate:
k processes, each a ``Policy`` of its own (the base loaded k times). Processes load and take one
untimed warm-up step per session first, then all start training together (a start file).

Printed per k and side: aggregate tokens trained per second (all sessions' tokens over the
wall time from the common start to the last session's end), memory held (sum of VmRSS at the
end of training, and of VmHWM, the peak), p50/p99 latency of one forward_backward as its
caller sees it (waiting for its turn included), and the shared/separate ratios, all measured in
the same run; then the load average, since the machine may be shared.

    .venv/bin/python bench/shared_lora_training.py [--ks 1,4,16] [--steps 6]
    .venv/bin/python bench/shared_lora_training.py --quick        # k = 1, 4; 3 steps
    python bench/shared_lora_training.py --shape qwen2.5-0.5b --device cuda   # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog
import torch
import transformers

RANKS = (4, 8, 16, 32)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def session_spec(base: str, index: int):  # noqa: ANN201 - a ModelSpec (imported late)
    from opentinker.spec import LoraConfig, ModelSpec

    modules = ATTENTION + (MLP if index % 2 else ())
    rank = RANKS[index % len(RANKS)]
    return ModelSpec(
        base_model=base, lora=LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=modules)
    )


def batch(index: int, step: int, args: argparse.Namespace, vocab: int) -> list:
    from opentinker.services.trainer.session.data import Datum

    gen = torch.Generator().manual_seed(1000 * index + step)
    out = []
    for _ in range(args.batch):
        ids = torch.randint(3, vocab, (args.length + 1,), generator=gen).tolist()
        out.append(Datum(ids[:-1], ids[1:]))
    return out


def training_session(policy, session_id: str, root: Path, run_work=None):  # noqa: ANN001, ANN201
    """A real TrainingSession; its sampler is never called (no sampling here)."""
    import grpc

    from opentinker.services.trainer.session.sampler import SessionSampler
    from opentinker.services.trainer.session.training_session import TrainingSession
    from opentinker.services.trainer.settings import TrainerSettings
    from opentinker.session_config import SessionConfig

    channel = grpc.aio.insecure_channel("127.0.0.1:9")
    return TrainingSession(
        job_id=session_id,
        tenant_id=f"tenant-{session_id}",
        policy=policy,
        sampler=SessionSampler(channel, address="127.0.0.1:9", tolerance=1e-3),
        config=SessionConfig(max_batch_tokens=1 << 20),
        checkpoint_root=root,
        settings=TrainerSettings(),
        run_work=run_work,
    )


async def session_loop(session, index: int, args, vocab: int, latencies: list) -> int:  # noqa: ANN001
    from opentinker.services.trainer.session.objective import LossSpec
    from opentinker.services.trainer.session.training_session import AdamParams

    tokens = 0
    for step in range(args.steps):
        data = batch(index, step, args, vocab)
        started = time.perf_counter()
        out = await session.forward_backward(data, LossSpec("cross_entropy"))
        latencies.append(time.perf_counter() - started)
        tokens += int(out.metrics["tokens"])
        await session.optim_step(AdamParams(learning_rate=1e-4))
    return tokens


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


async def worker(args: argparse.Namespace) -> None:
    """One process: ``--indices`` sessions, shared on one host (or the one alone, a Policy)."""
    from opentinker.services.trainer.model.policy import Policy
    from opentinker.services.trainer.session.host import SharedLoraHost

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    transformers.utils.logging.disable_progress_bar()
    indices = [int(i) for i in args.indices.split(",")]
    root = Path(args.out).parent
    if args.side == "shared":
        host = SharedLoraHost(args.model, device=args.device, max_sessions=len(indices))
        sessions = []
        for i in indices:
            tenant = host.add_session(f"s{i}", session_spec(args.model, i), seed=i)
            sessions.append(
                training_session(tenant, f"s{i}", root, functools.partial(host.run, f"s{i}"))
            )
    else:
        (i,) = indices
        torch.manual_seed(i)
        policy = Policy(session_spec(args.model, i), learning_rate=1e-4, device=args.device, seed=i)
        sessions = [training_session(policy, f"s{i}", root)]
    vocab = sessions[0].policy.model.get_input_embeddings().num_embeddings
    # One untimed step per session first (both sides): a process's first backward pass and
    # each adapter's first AdamW step pay one-time costs a long-lived trainer pays once.
    warm = argparse.Namespace(**{**vars(args), "steps": 1})
    await asyncio.gather(
        *(session_loop(s, 10_000 + i, warm, vocab, []) for i, s in enumerate(sessions))
    )
    Path(args.out + ".ready").write_text("")
    while not Path(args.go).exists():
        await asyncio.sleep(0.01)
    latencies: list[float] = []
    started = time.time()
    tokens = await asyncio.gather(
        *(
            session_loop(s, i, args, vocab, latencies)
            for s, i in zip(sessions, indices, strict=True)
        )
    )
    ended = time.time()
    result = {
        "tokens": sum(tokens),
        "start": started,
        "end": ended,
        "latencies": latencies,
        "rss": status_kib("VmRSS") * 1024,
        "hwm": status_kib("VmHWM") * 1024,
    }
    Path(args.out).write_text(json.dumps(result))


def run_side(side: str, k: int, args: argparse.Namespace, work: Path, tag: str) -> dict:
    """Start the side's processes, let them train together, gather their results."""
    go = work / f"go-{side}-{k}-{tag}"
    groups = [list(range(k))] if side == "shared" else [[i] for i in range(k)]
    outs, procs = [], []
    for n, group in enumerate(groups):
        out = work / f"{side}-{k}-{tag}-{n}.json"
        outs.append(out)
        command = [
            sys.executable, __file__, "--worker", "--side", side, "--model", args.model,
            "--indices", ",".join(map(str, group)), "--out", str(out), "--go", str(go),
            "--steps", str(args.steps), "--batch", str(args.batch), "--length", str(args.length),
            "--device", args.device,
        ]  # fmt: skip
        procs.append(subprocess.Popen(command))
    while not all(Path(str(o) + ".ready").exists() for o in outs):
        if any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit(f"a {side} worker failed to start")
        time.sleep(0.05)
    go.write_text("")
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"a {side} worker failed (exit {proc.returncode})")
    results = [json.loads(o.read_text()) for o in outs]
    latencies = sorted(x for r in results for x in r["latencies"])
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "rss": sum(r["rss"] for r in results),
        "hwm": sum(r["hwm"] for r in results),
        "p50": latencies[len(latencies) // 2],
        "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def measured_sides(k: int, args: argparse.Namespace, work: Path) -> dict[str, dict]:
    """Each side ``--repeats`` times, alternating which goes first (the machine's load from
    others then falls on both alike); each figure is the median over the repeats."""
    runs: dict[str, list[dict]] = {"shared": [], "separate": []}
    for repeat in range(args.repeats):
        order = ("shared", "separate") if repeat % 2 == 0 else ("separate", "shared")
        for side in order:
            runs[side].append(run_side(side, k, args, work, tag=str(repeat)))
    return {
        side: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for side, results in runs.items()
    }


def model_dir(args: argparse.Namespace, work: Path) -> str:
    from opentinker.services.modeling.tiny_model import SHAPES, build_tiny_model

    if args.model:
        return args.model
    return str(build_tiny_model(work / "model", **SHAPES[args.shape]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ks", default="1,4,16")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, alternated")
    parser.add_argument("--quick", action="store_true", help="k = 1, 4; 3 steps; 1 repeat")
    parser.add_argument("--shape", default="tiny", help="tiny, or qwen2.5-0.5b (random init)")
    parser.add_argument("--model", default="", help="a local model folder instead of --shape")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--indices", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--go", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker(args))
        return
    if args.quick:
        args.ks, args.steps, args.repeats = "1,4", 3, 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        args.model = model_dir(args, work)
        report(args, work)


def report(args: argparse.Namespace, work: Path) -> None:
    print(
        f"model {args.model if not args.model.startswith(str(work)) else args.shape} on "
        f"{args.device}; batch {args.batch} x {args.length} tokens; {args.steps} steps; "
        f"torch threads per process {torch.get_num_threads()}; median of {args.repeats}"
    )
    print(
        f"{'k':>3} {'side':>8} {'tok/s':>9} {'RSS MiB':>9} {'peak MiB':>9} "
        f"{'fb p50 ms':>10} {'fb p99 ms':>10}"
    )
    for k in (int(x) for x in args.ks.split(",")):
        sides = measured_sides(k, args, work)
        for side, r in sides.items():
            print(
                f"{k:>3} {side:>8} {r['tokens_per_s']:>9.0f} {r['rss'] / 2**20:>9.0f} "
                f"{r['hwm'] / 2**20:>9.0f} {1e3 * r['p50']:>10.1f} {1e3 * r['p99']:>10.1f}"
            )
        s, p = sides["shared"], sides["separate"]
        speedup = s["tokens_per_s"] / p["tokens_per_s"]
        print(
            f"{k:>3}   ratios: throughput shared/separate {speedup:.2f}x,"
            f" memory shared/separate {s['rss'] / p['rss']:.3f} (peak {s['hwm'] / p['hwm']:.3f})"
        )
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
