"""What the Tinker gateway adds per call: the same forward_backward and sample calls through
the official ``tinker`` SDK -> gateway (HTTP, protobuf, futures polled with retrieve_future)
-> trainer session, and straight to the trainer session over gRPC (opentinker SDK).

One LocalMesh (Redis, scheduler, EnvHub, a worker), the gateway in its own process
(``opentinker serve tinker-gateway``) and the tiny model; each path gets its own session job
(LoRA rank 4), both open side by side; after two unmeasured calls each, ``--calls`` blocking
calls of each kind go to one path and the other in turn. Printed: the median and p90
milliseconds per call of both paths and the gateway's overhead (median difference).

    .venv/bin/python bench/gateway_overhead.py [--calls 10] [--tokens 32] [--samples 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import tinker
from tinker import types

import opentinker
from opentinker import AdamParams, Datum
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.spec import SamplingParams


def timed_pairs(a: Callable[[], object], b: Callable[[], object], n: int):
    """Milliseconds of ``n`` calls of ``a`` and of ``b``, alternating (machine noise hits both
    alike), after two unmeasured calls of each."""
    for _ in range(2):
        a(), b()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(n):
        for call, out in ((a, times[0]), (b, times[1])):
            start = time.perf_counter()
            call()
            out.append((time.perf_counter() - start) * 1000)
    return times


def compare(client: opentinker.Client, model: Path, url: str, key: str, tokens, args) -> dict:
    """{call: (gRPC ms, gateway ms)} with a session of each kind open side by side."""
    service = tinker.ServiceClient(base_url=url, api_key=f"tml-{key}")
    trainer = service.create_lora_training_client(base_model="tiny", rank=4).result()
    with client.training_session(base_model=str(model), lora_rank=4) as session:
        datum = Datum.from_sequence(tokens)
        sdk_datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64))
            },
        )
        fb = timed_pairs(
            lambda: session.forward_backward([datum], "cross_entropy"),
            lambda: trainer.forward_backward([sdk_datum], "cross_entropy").result(),
            args.calls,
        )
        session.optim_step(AdamParams(learning_rate=1e-3))
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        session.save_weights_for_sampler()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        sampling = SamplingParams(max_new_tokens=args.samples)
        params = types.SamplingParams(max_tokens=args.samples)
        prompt = types.ModelInput.from_ints(tokens[:4])
        sample = timed_pairs(
            lambda: session.sample(tokens[:4], sampling=sampling),
            lambda: sampler.sample(prompt, 1, params).result(),
            args.calls,
        )
    service.close("success").result()
    return {"forward_backward": fb, "sample": sample}


@contextlib.contextmanager
def gateway_process(scheduler: str, model: Path, log: Path) -> Iterator[str]:
    """``opentinker serve tinker-gateway`` on a free port; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {
        "OPENTINKER_GATEWAY_PORT": str(port),
        "OPENTINKER_GATEWAY_SCHEDULER_ADDRESS": scheduler,
        "OPENTINKER_GATEWAY_BASE_MODELS": json.dumps({"tiny": str(model)}),
    }
    cli = [sys.executable, "-m", "opentinker", "serve", "tinker-gateway"]
    with log.open("w") as out:
        process = subprocess.Popen(cli, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"the gateway did not start; see {log}") from None
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def report(name: str, grpc_ms: list[float], http_ms: list[float]) -> None:
    def p90(xs: list[float]) -> float:
        return sorted(xs)[int(0.9 * (len(xs) - 1))]

    g, h = statistics.median(grpc_ms), statistics.median(http_ms)
    print(
        f"{name:17s} gRPC median {g:7.1f} ms p90 {p90(grpc_ms):7.1f} | gateway median "
        f"{h:7.1f} ms p90 {p90(http_ms):7.1f} | overhead {h - g:+7.1f} ms per call"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per datum")
    parser.add_argument("--samples", type=int, default=4, help="new tokens per sample")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    tokens = [5 + (i % 40) for i in range(args.tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        model = ensure_tiny_model(Path(tmp) / "tiny")
        with LocalMesh(MeshSettings(run_root=Path(tmp) / "mesh")) as mesh:
            log = Path(tmp) / "gateway.log"
            with (
                opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client,
                gateway_process(mesh.scheduler_address, model, log) as url,
            ):
                results = compare(client, model, url, mesh.api_key, tokens, args)
    print(f"{args.calls} calls each, {args.tokens} tokens per datum, {args.samples} new tokens")
    for name, (grpc_ms, http_ms) in results.items():
        report(name, grpc_ms, http_ms)


if __name__ == "__main__":
    main()
