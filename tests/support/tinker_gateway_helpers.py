"""Fixtures for tests that drive the gateway with the real ``tinker`` SDK: a real mesh
(Redis, scheduler, envhub, worker) and a gateway in front of it, one of each per test module.
Import the fixtures into a test module: ``from tinker_gateway_helpers import gateway, ...``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from opentinker.services.gateway.in_thread import running_gateway
from opentinker.services.gateway.settings import GatewaySettings
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings

BASE = "opentinker/tiny-letter"  # a Tinker name the gateway maps to the local model dir
QWEN = "Qwen/Qwen3-8B"  # the cookbook's name (its renderer), mapped to the same tiny model


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with LocalMesh(MeshSettings(run_root=tmp_path_factory.mktemp("mesh"))) as running:
        yield running


@pytest.fixture(scope="module")
def gateway(mesh, letter_model_dir: Path, monkeypatch_module):
    monkeypatch_module.setenv("TINKER_TELEMETRY", "0")
    settings = GatewaySettings(
        scheduler_address=mesh.scheduler_address,
        port=0,  # a free one
        base_models={BASE: str(letter_model_dir), QWEN: str(letter_model_dir)},
        long_poll_s=2.0,
        checkpoint_root=mesh.checkpoint_root,
    )
    with running_gateway(settings) as url:
        yield url


@contextlib.contextmanager
def service_client(url: str, api_key: str) -> Iterator[tinker.ServiceClient]:
    """A ServiceClient closed at the end: its heartbeat thread would outlive the gateway and
    log connection errors for minutes, into later tests and past pytest's end. A close the
    gateway refuses (a session it expired, a bad key) is fine here."""
    service = tinker.ServiceClient(base_url=url, api_key=f"tml-{api_key}")
    try:
        yield service
    finally:
        with contextlib.suppress(Exception):
            service.close("success").result()


@pytest.fixture(scope="module")
def service(gateway, mesh):
    with service_client(gateway, mesh.api_key) as client:
        yield client


def sft_datum(tokens: list[int]) -> types.Datum:
    """Tokens[:-1] in, tokens[1:] out, every target weighted 1."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )
