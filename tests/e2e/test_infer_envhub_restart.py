"""``run_inference`` (``opentinker infer --local``) through an EnvHub that dies mid-run: a real
EnvHub serving the built-in letter env is stopped after the first chunk of episodes, and
started again on its port. The run reconnects, as a training rollout does (EnvHubLink), and
every episode plays; an EnvHub that never comes back fails the run within the reconnect bound,
naming EnvHub, instead of writing the later episodes out as ENV_ERROR rows."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from envhub_helpers import RestartableHub

from opentinker.errors import UnavailableError
from opentinker.inference_rows import InferenceSummary
from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.inference import run_inference
from opentinker.spec import SamplingParams

pytestmark = pytest.mark.integration

CHUNK = 2  # episodes played together; EnvHub goes away once the first chunk is written


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


async def _infer_while_envhub_goes(
    *, come_back: bool, model_dir: Path, output: Path, **options: object
) -> InferenceSummary:
    """run_inference of 4 letter episodes in a thread, through a real EnvHub; after the first
    chunk, EnvHub stops (and, with come_back, starts again on its port) before the run goes on."""
    loop = asyncio.get_running_loop()
    hub = RestartableHub(builtin_envs=["letter"])
    await hub.start()

    async def away() -> None:
        await hub.stop()
        if come_back:
            await hub.start()

    def progress(done: int, total: int) -> None:
        if done == CHUNK:  # blocks the run until EnvHub is down (and back)
            asyncio.run_coroutine_threadsafe(away(), loop).result(30)

    try:
        return await asyncio.to_thread(
            run_inference,
            model=str(model_dir),
            env_name="letter",
            envhub_address=hub.address,
            episodes=2 * CHUNK,
            output=output,
            env_options={"num_letters": "4"},
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2),
            concurrency=CHUNK,
            device="cpu",
            env_timeout_s=10,
            progress=progress,
            **options,
        )
    finally:
        await hub.stop()


def _rows(output: Path) -> list[dict]:
    return [json.loads(line) for line in output.read_text().splitlines()]


def test_infer_rides_out_envhub_restarted_mid_run(model_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "rows.jsonl"
    run = _infer_while_envhub_goes(come_back=True, model_dir=model_dir, output=output)
    summary = asyncio.run(asyncio.wait_for(run, 120))
    rows = _rows(output)
    assert [(r["finish_reason"], r["env_retries"]) for r in rows] == [("ENV_DONE", 0)] * 4, [
        r["finish_detail"] for r in rows
    ]
    assert summary.episodes == 4 and summary.env_errors == 0


def test_infer_fails_naming_envhub_when_it_stays_away(model_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "rows.jsonl"
    run = _infer_while_envhub_goes(
        come_back=False, model_dir=model_dir, output=output, envhub_reconnect_s=2.0
    )
    with pytest.raises(UnavailableError, match=r"EnvHub at 127\.0\.0\.1:\d+ .* within 2 s"):
        asyncio.run(asyncio.wait_for(run, 120))
    # The first chunk's rows, and no ENV_ERROR row for the episodes EnvHub took with it.
    assert [r["finish_reason"] for r in _rows(output)] == ["ENV_DONE"] * CHUNK
