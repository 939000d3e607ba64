"""Start latency and rate of small jobs through the real mesh: cold (no spares), warm (a spare
serves one job and exits) and reused (a spare whose job ended well serves the tenant's next).

For each mode a fresh ``LocalMesh`` (Redis, scheduler, EnvHub, one worker with ``--slots`` CPU
slots) runs one unmeasured priming job per client at once on the tiny model (the worker learns
the base model; in the warm modes its spares are made; reusing, each client's pair is kept),
waits until every spare the worker started is ready, then
``--clients`` concurrent clients each submit one-step jobs one after another (closed loop,
``--gap`` seconds of think time between a client's jobs) until ``--jobs`` have run. Per job,
from the scheduler's event stream (one host, one clock):

    submit -> RUNNING      the client's submit call to the RUNNING event (the rollout
                           serves; the trainer was started beside it, at the same time)
    submit -> first step   the client's submit call to the first step's metrics event
    submit -> end          the client's submit call to the job's SUCCEEDED (its last update)

Printed: p50 and p99 of both per mode, the ratio cold/reused, the jobs per second each mode
completed (measured jobs over the time from the first submit to the last end), how many
processes a spare took over, the 1-minute load average at the end (the machine may be
shared: compare modes of one run), and the CPU seconds per job of the mesh's processes by kind
(what bounds the rate on a machine of few cores: jobs/s <= cores / CPU s per job; in cold mode
a job's exited processes count in the worker's).

    .venv/bin/python bench/start_latency.py [--jobs 10] [--clients 2] [--slots 2] [--spares 2]
        [--gap 0] [--modes cold,warm,reused]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
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
    """Until at least ``count`` spares were started and every one started is ready (none
    still importing or loading while jobs are measured)."""
    deadline = time.monotonic() + timeout_s
    spares = mesh.run_root / "jobs" / "spares"
    while time.monotonic() < deadline:
        logs = list(spares.glob("*.log")) if spares.exists() else []
        if len(logs) >= count and all("spare_ready" in p.read_text() for p in logs):
            time.sleep(1.0)  # none more started meanwhile (the pool tops up after a take)
            if len(list(spares.glob("*.log"))) == len(logs):
                return
        time.sleep(0.5)
    raise RuntimeError(f"{count} spares were not ready within {timeout_s:.0f} s")


def tree_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system, and of their reaped children) of this process's descendants
    now, by kind: scheduler, worker, envhub, rollout, trainer, redis-server (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    procs: dict[int, tuple[int, float, str]] = {}  # pid -> (parent, cpu s, kind)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = sum(int(f) for f in fields[11:15]) / tick  # utime stime cutime cstime
        words = [w.decode(errors="replace") for w in argv if w]
        kind = next((w.rsplit(".", 1)[-1] for w in words if "opentinker.services." in w), "")
        if not kind and words:  # redis-server names itself "redis-server HOST:PORT"
            kind = Path(words[0].split()[0]).name
        procs[int(entry.name)] = (int(fields[1]), cpu, kind)
    mine = {os.getpid()}
    by_kind: dict[str, float] = {}
    for _ in range(8):  # descendants, a generation at a time
        for pid, (parent, cpu, kind) in procs.items():
            if parent in mine and pid not in mine:
                mine.add(pid)
                by_kind[kind] = by_kind.get(kind, 0.0) + cpu
    return by_kind


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
        # Priming, not measured: one job per client at once, so the worker knows the model and,
        # reusing, keeps a process pair for each client (the steady state of a busy tenant).
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(lambda c: run_job(c, one_step_job(model, seed=0)), clients))
        if spares:
            wait_for_spares(mesh, 2 * spares)
        seeds = iter(range(1, args.jobs + 1))

        def client_loop(client: opentinker.Client) -> list[Timing]:
            out = []
            for seed in seeds:  # shared iterator: each job is run by exactly one client
                out.append(run_job(client, one_step_job(model, seed)))
                time.sleep(args.gap)  # a person's think time between jobs
            return out

        started, cpu_before = time.time(), tree_cpu_s()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            results = [t for ts in pool.map(client_loop, clients) for t in ts]
        rate = len(results) / (time.time() - started)
        load = os.getloadavg()[0]  # the machine is shared: say how busy it was
        cpu = {k: v - cpu_before.get(k, 0.0) for k, v in tree_cpu_s().items()}
        for client in clients:
            client.close()
        warm = sum(
            "event='warm_start'" in (p / "attempt-1" / f"{name}.log").read_text()
            for t in results
            for p in [mesh.run_root / "jobs" / t.job_id]
            for name in ("rollout", "trainer")
        )
        print(
            f"  {root.name}: {warm} of {2 * len(results)} processes warm, {rate:.2f} jobs/s, "
            f"load average {load:.1f} on {os.cpu_count()} cores"
        )
        per_job = ", ".join(f"{k} {v / len(results):.2f}" for k, v in sorted(cpu.items()) if v)
        print(f"    CPU s per job: {sum(cpu.values()) / len(results):.2f} ({per_job})")
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
