"""Checkpoint download, the SDK's way (``tinker checkpoint download``, RestClient's
get_external_weights_urls): a training client saves its weights in an external format
(save_weights_external: the trainer's state ``ext.<name>``, Hugging Face PEFT files), and the
gateway hands out signed, expiring URLs, one per file, that need no API key (like presigned
object-store URLs: the signature is the credential). Files served: the adapter, its config and
the tokenizer; never the optimizer state or RNG.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from opentinker.errors import InvalidArgumentError
from opentinker.services.gateway.futures import Result
from opentinker.services.gateway.models import EXTERNAL_KIND, TinkerPath
from opentinker.services.gateway.runs import saved_state, set_ttl
from opentinker.services.gateway.signing import sign, verify
from opentinker.services.gateway.state import Gateway
from opentinker.services.gateway.tenancy import Caller
from opentinker.services.gateway.training_routes import ordered, start_future

URL_TTL_S = 3600  # a signed URL works this long
PRIVATE_FILES = {"optimizer.pt", "rng.pt", "trainer_state.json", "manifest.json", "session.json"}


async def save_weights_external(gw: Gateway, caller: Caller, body: dict) -> dict:
    if body.get("age_encryption_recipients"):
        raise InvalidArgumentError("age_encryption_recipients: encrypted exports are not served")
    model = await gw.models.get(body["model_id"], caller)
    path = TinkerPath(model.job_id, EXTERNAL_KIND, body.get("path") or f"step-{model.gate.next}")

    async def work() -> Result:
        save = lambda: model.session.save_state_async(path.trainer_name)  # noqa: E731
        await ordered(model, body.get("seq_id"), save)
        if body.get("ttl_seconds") is not None:
            await asyncio.to_thread(set_ttl, gw, caller, path, body["ttl_seconds"])
        return Result({"path": str(path), "type": "save_weights_external"})

    return start_future(gw, caller, work(), model)


async def external_weights_urls(gw: Gateway, caller: Caller, body: dict) -> dict:
    run, checkpoint = body["training_run_id"], body["checkpoint_id"]
    path = TinkerPath.parse(f"tinker://{run}/{checkpoint}")
    if path.kind != EXTERNAL_KIND:
        raise InvalidArgumentError(
            f"checkpoint_id: {checkpoint!r} is not external weights; save them with "
            "save_weights_external (or `tinker checkpoint download` does it for you)"
        )
    folder = await asyncio.to_thread(saved_state, gw, caller, path)
    expires = int(time.time()) + URL_TTL_S
    base = str(body["base_url"]).rstrip("/")
    urls = {
        name: f"{base}/api/v1/files/{sign(gw.download_secret, str(file), expires)}"
        for name, file in _public_files(folder).items()
    }
    return {"urls": urls, "expires": datetime.fromtimestamp(expires, tz=UTC).isoformat()}


def file_route(gw: Gateway):
    """The handler of GET /api/v1/files/<signed token> (no API key: the signature is it)."""
    return partial(serve_file, gw.download_secret)


async def serve_file(secret: bytes, request: Request) -> Response:
    """The file, if the signature holds and has not expired."""
    try:
        file, expires = verify(secret, request.path_params["token"])
    except ValueError as err:
        return JSONResponse({"error": str(err), "category": "user"}, status_code=403)
    if expires < time.time():
        return JSONResponse({"error": "this download URL has expired", "category": "user"}, 403)
    if not Path(file).is_file():
        return JSONResponse({"error": "the checkpoint is gone", "category": "user"}, 404)
    return FileResponse(file)


def _public_files(folder: Path) -> dict[str, Path]:
    """The state's shareable files by their name in the export (one model folder inside)."""
    steps = [d for d in sorted(folder.iterdir()) if d.is_dir()]
    if not steps:
        return {}
    return {
        str(f.relative_to(steps[-1])): f
        for f in sorted(steps[-1].rglob("*"))
        if f.is_file() and f.name not in PRIVATE_FILES
    }
