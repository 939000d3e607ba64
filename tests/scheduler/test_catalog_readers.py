"""Readers of the scheduler's model catalog besides the SDK: the Tinker gateway's
capabilities (beside the gateway's own configured names) and the dashboard's models page. The
session's real scheduler; each test removes the model it registered."""

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


def test_the_dashboard_shows_the_catalog(identities) -> None:
    from starlette.testclient import TestClient

    from opentinker.services.dashboard.app import create_app
    from opentinker.services.dashboard.settings import DashboardSettings

    settings = DashboardSettings(
        scheduler_address=identities.scheduler_address, envhub_address="127.0.0.1:1"
    )
    gemma = ModelInfo(name="gemma-3-270m", architecture="gemma3_text", chat_template="plain")
    with (
        TestClient(create_app(settings), follow_redirects=False) as web,
        Client(identities.scheduler_address, api_key=identities.admin_key) as admin,
    ):
        assert web.post("/login", data={"api_key": identities.user_key}).status_code == 303
        assert "lists no models" in web.get("/models").text
        admin.register_model(gemma)
        try:
            page = web.get("/models").text
        finally:
            admin.remove_model(gemma.name)
    assert 'data-model="gemma-3-270m"' in page and "gemma3_text" in page
    assert "plain (set)" in page


def test_a_catalog_models_tokenizer_is_loaded_from_its_location(identities) -> None:
    """get_info's tokenizer_id (what the tinker SDK's get_tokenizer() loads) for a model named
    only in the catalog is the entry's location, not the bare name the hub does not have."""
    from opentinker.services.gateway.app import tokenizer_location

    tiny = ModelInfo(name="tiny-test-model", location="/models/tiny", architecture="qwen2")
    with Client(identities.scheduler_address, api_key=identities.admin_key) as admin:
        admin.register_model(tiny)
        try:
            catalog = admin.models()
        finally:
            admin.remove_model(tiny.name)
    assert tokenizer_location("tiny-test-model", catalog) == "/models/tiny"
    assert tokenizer_location("Qwen/Qwen3-8B", catalog) == "Qwen/Qwen3-8B"  # a hub id as given
