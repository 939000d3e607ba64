"""The model catalog (models.proto): admins register and remove models, every user lists them
(gRPC, ``Client.models()``, ``opentinker models list``), and while it holds a model a job
naming another is refused at submit with the names the pool has. A real scheduler on a real
Redis; the sync SDK client and the CLI run in a thread beside the scheduler's event loop."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
from async_guard import run
from identity_helpers import api_key

from opentinker import models_cli
from opentinker.catalog import ModelInfo, describe_folder
from opentinker.cli import main as cli_main
from opentinker.client import Client
from opentinker.common.v1 import common_pb2
from opentinker.errors import PermissionDeniedError
from opentinker.scheduler.v1 import models_pb2, models_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.scheduler.server import running_scheduler
from opentinker.services.scheduler.settings import SchedulerSettings
from opentinker.spec import JobSpec, ModelSpec, RlConfig, to_proto

pytestmark = pytest.mark.integration


def _spec(base_model: str, finetune: str = "lora", kind: str = "rl") -> common_pb2.JobSpec:
    return to_proto(
        JobSpec(
            kind=kind,  # type: ignore[arg-type]
            model=ModelSpec(base_model=base_model, finetune=finetune),  # type: ignore[arg-type]
            rl=RlConfig(env_name="letter", steps=1),
        )
    )


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as ended:
        cli_main(list(argv))
    return int(ended.value.code or 0), capsys.readouterr().out


def test_admins_register_users_list_and_submit_is_checked(redis_url: str) -> None:
    async def main() -> None:
        settings = SchedulerSettings(redis_url=redis_url, port=0, heartbeat_interval_s=0.2)
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            ids = running.stores.identity
            admin_key = await api_key(ids, tenant="system", user="root", admin=True)
            user_key = await api_key(ids, tenant="acme", user="alice")
            async with (
                aio_channel(running.address, credential=admin_key) as admin_ch,
                aio_channel(running.address, credential=user_key) as user_ch,
            ):
                admin = models_pb2_grpc.ModelServiceStub(admin_ch)
                models = models_pb2_grpc.ModelServiceStub(user_ch)
                jobs = scheduler_pb2_grpc.SchedulerServiceStub(user_ch)

                async def submit(spec: common_pb2.JobSpec) -> common_pb2.Job:
                    request = scheduler_pb2.SubmitJobRequest(spec=spec)
                    return (await jobs.SubmitJob(request, timeout=5)).job

                # An empty catalog refuses nothing: what many pools (and tests) run with
                assert (await submit(_spec("Qwen/Qwen2.5-1.5B"))).job_id
                smol = models_pb2.Model(
                    name="SmolLM2-135M-Instruct",
                    location="/models/smollm2",
                    architecture="llama",
                    parameters=134_515_008,
                    context_length=8192,
                    has_chat_template=True,
                    finetunes=[common_pb2.FINETUNE_MODE_LORA],
                )
                # A member may list but not register
                with pytest.raises(grpc.aio.AioRpcError) as denied:
                    await models.RegisterModel(models_pb2.RegisterModelRequest(model=smol))
                assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
                stored = (
                    await admin.RegisterModel(models_pb2.RegisterModelRequest(model=smol))
                ).model
                assert stored.registered_unix_s > 0
                await admin.RegisterModel(
                    models_pb2.RegisterModelRequest(model=models_pb2.Model(name="tiny-qwen2"))
                )
                listed = (await models.ListModels(models_pb2.ListModelsRequest())).models
                assert [m.name for m in listed] == ["SmolLM2-135M-Instruct", "tiny-qwen2"]
                assert listed[0].parameters == 134_515_008 and listed[0].location

                # Now a model the pool does not have is refused, naming the ones it has
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await submit(_spec("Qwen/Qwen2.5-1.5B"))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                details = refused.value.details() or ""
                assert (
                    "model.base_model: 'Qwen/Qwen2.5-1.5B' is not a model of this pool" in details
                )
                assert "SmolLM2-135M-Instruct, tiny-qwen2" in details
                # By name: runs on the entry's location; by location: accepted as it is
                job = await submit(_spec("SmolLM2-135M-Instruct"))
                assert job.spec.model.base_model == "/models/smollm2"
                assert (await submit(_spec("/models/smollm2/"))).job_id
                # A finetune the entry does not allow; inference does not train, so it may
                with pytest.raises(grpc.aio.AioRpcError) as full:
                    await submit(_spec("SmolLM2-135M-Instruct", finetune="full"))
                assert "model.finetune: 'full' is not run on 'SmolLM2-135M-Instruct'" in (
                    full.value.details() or ""
                )
                # A checkpoint of one of the tenant's own jobs names no catalog model
                ckpt = f"/srv/checkpoints/{job.job_id}/step-000001"
                assert (await submit(_spec(ckpt, finetune="full"))).job_id
                # Bad entries are refused naming the field; removal of an unknown one NOT_FOUND
                bad = models_pb2.Model(name="has space", chat_template="chatml")
                with pytest.raises(grpc.aio.AioRpcError) as invalid:
                    await admin.RegisterModel(models_pb2.RegisterModelRequest(model=bad))
                assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "name 'has space'" in (invalid.value.details() or "")
                assert "chat_template" in (invalid.value.details() or "")
                with pytest.raises(grpc.aio.AioRpcError) as missing:
                    await admin.RemoveModel(models_pb2.RemoveModelRequest(name="nope"))
                assert missing.value.code() == grpc.StatusCode.NOT_FOUND
                await admin.RemoveModel(models_pb2.RemoveModelRequest(name="tiny-qwen2"))
                page = await models.ListModels(models_pb2.ListModelsRequest(page_size=1))
                assert [m.name for m in page.models] == ["SmolLM2-135M-Instruct"]
                assert not page.next_page_token

    run(main)


def test_client_and_cli_list_and_register(
    redis_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"model_type": "gemma3_text", "max_position_embeddings": 32768})
    )
    header = json.dumps({"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}})
    raw = header.encode()
    (folder / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(48))
    assert describe_folder(folder) == {
        "architecture": "gemma3_text",
        "context_length": 32768,
        "parameters": 12,
        "has_chat_template": False,
    }

    async def main() -> None:
        settings = SchedulerSettings(redis_url=redis_url, port=0, heartbeat_interval_s=0.2)
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            ids = running.stores.identity
            admin_key = await api_key(ids, tenant="system", user="root", admin=True)
            user_key = await api_key(ids, tenant="acme", user="alice")
            monkeypatch.setenv("OPENTINKER_SCHEDULER_ADDRESS", running.address)
            monkeypatch.setattr(models_cli.console, "width", 200)  # the table, not wrapped

            def as_people() -> None:
                code, out = _cli(capsys, "--api-key", user_key, "models", "list")
                assert code == 0 and "lists no models" in out
                code, out = _cli(capsys, "--api-key", user_key, "models", "register", "x")
                assert code == 2 and "PERMISSION_DENIED" in out
                code, out = _cli(
                    capsys,
                    *("--api-key", admin_key, "models", "register", "gemma-3-270m"),
                    *("--location", str(folder), "--finetune", "lora", "--chat-template", "plain"),
                )
                assert code == 0, out
                code, out = _cli(capsys, "--api-key", user_key, "models", "list")
                assert code == 0
                assert "gemma-3-270m" in out and "gemma3_text" in out and "plain (set)" in out
                with Client(running.address, api_key=user_key) as client:
                    (model,) = client.models()
                    assert model == ModelInfo(
                        name="gemma-3-270m",
                        location=str(folder.resolve()),
                        architecture="gemma3_text",
                        parameters=12,
                        context_length=32768,
                        finetunes=("lora",),
                        chat_template="plain",
                        registered_unix_s=model.registered_unix_s,
                    )
                    with pytest.raises(PermissionDeniedError):
                        client.remove_model("gemma-3-270m")
                with Client(running.address, api_key=admin_key) as admin:
                    admin.remove_model("gemma-3-270m")
                    assert admin.models() == []

            await asyncio.to_thread(as_people)

    run(main)


def test_up_and_demo_register_the_tiny_model(redis_url: str, tmp_path: Path) -> None:
    """What `opentinker up`/`demo` do once the mesh is up: the tiny model enters the catalog
    with what its folder says, registered with the admin key the scheduler bootstrapped."""
    from opentinker.services.launcher.catalog_seed import TINY_MODEL_NAME, register_local_model
    from opentinker.services.modeling.tiny_model import ensure_tiny_model

    tiny = ensure_tiny_model(tmp_path / "tiny-qwen2")
    secrets = tmp_path / "secrets"

    async def main() -> None:
        settings = SchedulerSettings(
            redis_url=redis_url, port=0, heartbeat_interval_s=0.2, bootstrap_dir=secrets
        )
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            user_key = await api_key(running.stores.identity, tenant="acme", user="alice")

            def seed_and_list() -> list[ModelInfo]:
                register_local_model(
                    running.address, secrets, tiny, name=TINY_MODEL_NAME, description="demo"
                )
                with Client(running.address, api_key=user_key) as client:
                    client.submit(
                        JobSpec(
                            model=ModelSpec(base_model=TINY_MODEL_NAME),
                            rl=RlConfig(env_name="letter", steps=1),
                        )
                    )
                    return client.models()

            (model,) = await asyncio.to_thread(seed_and_list)
            assert model.name == "tiny-qwen2" and model.location == str(tiny.resolve())
            assert model.architecture == "qwen2" and model.has_chat_template
            assert model.parameters > 100_000 and model.context_length > 0

    run(main)


def test_models_import_register_puts_the_gguf_in_the_catalog(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`opentinker models import F.gguf --out DIR --register`: the import's figures (the
    file's architecture, parameters, context and chat template) become the catalog entry."""
    from gguf_files import tiny_llama, write_llama_gguf

    gguf_file = write_llama_gguf(tmp_path / "m.gguf", tiny_llama())
    out = tmp_path / "imported"

    async def main() -> None:
        settings = SchedulerSettings(redis_url=redis_url, port=0, heartbeat_interval_s=0.2)
        async with running_scheduler(settings, stop_grace_s=0.2) as running:
            admin_key = await api_key(
                running.stores.identity, tenant="system", user="root", admin=True
            )

            def import_and_list() -> list[ModelInfo]:
                code, said = _cli(
                    capsys,
                    *("--scheduler", running.address, "--api-key", admin_key, "models"),
                    *("import", str(gguf_file), "--out", str(out), "--register"),
                    *("--name", "tiny-llama"),
                )
                assert code == 0, said
                assert '"base_model": "tiny-llama"' in said
                with Client(running.address, api_key=admin_key) as client:
                    return client.models()

            (model,) = await asyncio.to_thread(import_and_list)
            assert (model.name, model.location) == ("tiny-llama", str(out.resolve()))
            assert model.architecture == "llama" and model.parameters > 0
            assert model.has_chat_template and model.description.endswith("from m.gguf")

    run(main)
