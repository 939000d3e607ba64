"""The Tinker gateway's capabilities list the scheduler's model catalog beside the gateway's
own configured names (the session's real scheduler; the model is removed again after)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from opentinker.catalog import ModelInfo
from opentinker.client import Client
from opentinker.services.gateway.in_thread import running_gateway
from opentinker.services.gateway.settings import GatewaySettings

pytestmark = pytest.mark.integration


@pytest.fixture()
def gateway(identities, tmp_path: Path) -> Iterator[str]:
    settings = GatewaySettings(
        scheduler_address=identities.scheduler_address,
        port=0,
        checkpoint_root=tmp_path,
        base_models={"Qwen/Qwen3-8B": "/models/qwen3-8b"},
    )
    with running_gateway(settings) as url:
        yield url


def test_capabilities_list_the_catalog(gateway, identities) -> None:
    smol = ModelInfo(
        name="SmolLM2-135M-Instruct",
        location="/models/smollm2",
        architecture="llama",
        context_length=8192,
        finetunes=("full",),
    )
    with Client(identities.scheduler_address, api_key=identities.admin_key) as admin:
        admin.register_model(smol)
        try:
            answer = httpx.get(
                f"{gateway}/api/v1/get_server_capabilities",
                headers={"X-API-Key": f"tml-{identities.user_key}"},
            )
        finally:
            admin.remove_model(smol.name)
    assert answer.status_code == 200, answer.text
    models = answer.json()["supported_models"]
    assert [m["model_name"] for m in models] == ["Qwen/Qwen3-8B", "SmolLM2-135M-Instruct"]
    listed = models[1]
    assert listed["path"] == "/models/smollm2" and listed["max_context_length"] == 8192
    assert listed["trainable"] is False  # the pool runs only full fine-tuning on it; Tinker: LoRA
