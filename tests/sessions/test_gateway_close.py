"""Closing a Tinker session closes every model in it, even when one model's trainer is
already gone (its job was cancelled, or its worker died). Plain HTTP, as the SDK sends it."""

from __future__ import annotations

import time

import httpx
import pytest
from tinker_gateway_helpers import BASE, gateway, mesh, monkeypatch_module

import opentinker

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["gateway", "mesh", "monkeypatch_module"]  # fixtures used here


def test_finishing_a_session_closes_its_models_past_one_whose_trainer_died(gateway, mesh) -> None:
    headers = {"X-API-Key": f"tml-{mesh.api_key}"}

    def call(path: str, body: dict) -> dict:
        answer = httpx.post(f"{gateway}/api/v1/{path}", json=body, headers=headers, timeout=120)
        assert answer.status_code == 200, (path, answer.text)
        return answer.json()

    def create_model(session: str, seq: int) -> None:
        model = {"session_id": session, "model_seq_id": seq, "base_model": BASE}
        future = call("create_model", {**model, "lora_config": {"rank": 2}})
        while (done := call("retrieve_future", future))["type"] == "try_again":
            pass
        assert done["type"] == "create_model", done

    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client:
        session = call("create_session", {})["session_id"]
        jobs = []
        for seq in (0, 1):
            before = {j.job_id for j in client.list_jobs()}
            create_model(session, seq)
            [job_id] = {j.job_id for j in client.list_jobs()} - before
            jobs.append(job_id)
        dead, alive = jobs
        client.cancel(dead, reason="its trainer goes away under the gateway")
        while not client.get_job(dead).done:
            time.sleep(0.2)

        assert call(f"sessions/{session}/finish", {}) == {}  # the dead one is gone anyway
        deadline = time.monotonic() + 60
        while not client.get_job(alive).done and time.monotonic() < deadline:
            time.sleep(0.5)
        assert client.get_job(alive).state == "SUCCEEDED"  # closed: its device is free
