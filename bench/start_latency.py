"""Start latency and rate of small jobs through the real mesh: cold (no spares), warm (a spare
serves one job and exits) and reused (a spare whose job ended well serves the tenant's next).

For each mode a fresh ``LocalMesh`` (Redis, scheduler, EnvHub, one worker with ``--slots`` CPU
slots) runs one unmeasured priming job on the tiny model (the worker learns the base model; in
the warm modes its spares are made), waits until the worker's spares are ready, then
``--clients`` concurrent clients each submit one-step jobs one after another (closed loop,
``--gap`` seconds of think time between a client's jobs) until ``--jobs`` have run. Per job,
from the scheduler's event stream (one host, one clock):

    submit -> RUNNING      the client's submit call to the RUNNING event (the rollout
                           serves; the trainer was started beside it, at the same time)
    submit -> first step   the client's submit call to the first step's metrics event
    submit -> end          the client's submit call to the job's SUCCEEDED (its last update)

Printed: p50 and p99 of both per mode, the ratio cold/reused, the jobs per second each mode
completed (measured jobs over the time from the first submit to the last end), and how many
processes a spare took over.

    .venv/bin/python bench/start_latency.py [--jobs 10] [--clients 2] [--slots 2] [--spares 2]
        [--gap 0] [--modes cold,warm,reused]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import ensure_tiny_model


@dataclass(frozen=True)
class Timing:
    job_id: str
    to_running_s: float
    to_first_step_s: float
    to_end_s: float


def one_step_job(model: Path, seed: int) -> JobSpec:
    rl = RlConfig(
        env_name="letter",
        env_options={"num_letters": "4"},
        steps=1,
        prompts_per_step=2,
        samples_per_prompt=2,
        sampling=SamplingParams(max_new_tokens=1),
        seed=seed,
    )
    return JobSpec(name="start-latency", model=ModelSpec(base_model=str(model)), rl=rl)


def run_job(client: opentinker.Client, spec: JobSpec) -> Timing:
    submitted = time.time()
    job_id = client.submit(spec).job_id
    running = first_step = None
    for event in client.watch(job_id, timeout=600):
        if event.kind == "state" and event.state == "RUNNING" and running is None:
            running = event.time_unix_s
        if event.kind == "step" and first_step is None:
            first_step = event.time_unix_s
    final = client.get_job(job_id)
    if final.state != "SUCCEEDED" or running is None or first_step is None:
        raise RuntimeError(f"job {job_id} ended {final.state}: {final.reason}")
    return Timing(
        job_id, running - submitted, first_step - submitted, final.updated_unix_s - submitted
    )


def wait_for_spares(mesh: LocalMesh, count: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    spares = mesh.run_root / "jobs" / "spares"
    while time.monotonic() < deadline:
        logs = list(spares.glob("*.log")) if spares.exists() else []
        if sum("spare_ready" in p.read_text() for p in logs) >= count:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{count} spares were not ready within {timeout_s:.0f} s")


MODES = {"cold": (0, False), "warm": (None, False), "reused": (None, True)}  # spares, reuse


def measure(
    root: Path, model: Path, args: argparse.Namespace, spares: int, reuse: bool
) -> tuple[list[Timing], float]:
    """The timings of the measured jobs, and the jobs per second they were run at."""
    settings = MeshSettings(
        run_root=root, cpu_slots=args.slots, warm_spares=spares, spare_reuse=reuse
    )
    with LocalMesh(settings) as mesh:
        clients = [
            opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=30)
            for _ in range(args.clients)
        ]
        run_job(clients[0], one_step_job(model, seed=0))  # priming: not measured
        if spares:
            wait_for_spares(mesh, 2 * spares)
        seeds = iter(range(1, args.jobs + 1))

        def client_loop(client: opentinker.Client) -> list[Timing]:
            out = []
            for seed in seeds:  # shared iterator: each job is run by exactly one client
                out.append(run_job(client, one_step_job(model, seed)))
                time.sleep(args.gap)  # a person's think time between jobs
            return out

        started = time.time()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            results = [t for ts in pool.map(client_loop, clients) for t in ts]
        rate = len(results) / (time.time() - started)
        for client in clients:
            client.close()
        warm = sum(
            "event='warm_start'" in (p / "attempt-1" / f"{name}.log").read_text()
            for t in results
            for p in [mesh.run_root / "jobs" / t.job_id]
            for name in ("rollout", "trainer")
        )
        print(f"  {root.name}: {warm} of {2 * len(results)} processes warm, {rate:.2f} jobs/s")
    return results, rate


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(timings: list[Timing]) -> dict[str, float]:
    running = [t.to_running_s for t in timings]
    step = [t.to_first_step_s for t in timings]
    end = [t.to_end_s for t in timings]
    return {
        "end_p50": statistics.median(end),
        "end_p99": percentile(end, 99),
        "running_p50": statistics.median(running),
        "running_p99": percentile(running, 99),
        "step_p50": statistics.median(step),
        "step_p99": percentile(step, 99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10, help="measured jobs per mode")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2, help="the worker's CPU slots")
    parser.add_argument("--spares", type=int, default=2, help="warm modes' spares per model")
    parser.add_argument("--gap", type=float, default=0.0, help="s between a client's jobs")
    parser.add_argument("--modes", default="cold,warm,reused", help="of " + ",".join(MODES))
    parser.add_argument("--keep", type=Path, help="keep the meshes' files (logs) in this folder")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    results: dict[str, tuple[dict[str, float], float]] = {}
    with tempfile.TemporaryDirectory(prefix="start-latency-") as tmp:
        root = args.keep.resolve() if args.keep else Path(tmp)
        model = ensure_tiny_model(root / "tiny-qwen2")
        for mode in modes:
            spares, reuse = MODES[mode]
            timings, rate = measure(
                root / mode, model, args, args.spares if spares is None else spares, reuse
            )
            results[mode] = summary(timings), rate
    print(
        f"\n{args.jobs} one-step jobs per mode, {args.clients} clients, {args.slots} slots, "
        f"spares per model: {args.spares}, {args.gap:g} s between a client's jobs"
    )
    print(f"{'':22}" + "".join(f"{m:>10}" for m in modes), end="")
    ratio = "cold" in results and "reused" in results
    print(f"{'cold/reused':>13}" if ratio else "")
    rows = (
        ("running_p50", "submit->RUNNING p50"),
        ("running_p99", "submit->RUNNING p99"),
        ("step_p50", "submit->step 1 p50"),
        ("step_p99", "submit->step 1 p99"),
        ("end_p50", "submit->end p50"),
        ("end_p99", "submit->end p99"),
    )
    for key, label in rows:
        line = f"{label:22}" + "".join(f"{results[m][0][key]:>9.2f}s" for m in modes)
        if ratio:
            line += f"{results['cold'][0][key] / results['reused'][0][key]:>12.2f}x"
        print(line)
    line = f"{'jobs/s':22}" + "".join(f"{results[m][1]:>10.2f}" for m in modes)
    if ratio:
        line += f"{results['reused'][1] / results['cold'][1]:>12.2f}x"
    print(line)


if __name__ == "__main__":
    main()
