"""Images in observations: the geometry env's figures go through a real EnvHub byte for byte,
and replies past the image limits (count, size, MIME type) fail their episode by name."""

from __future__ import annotations

import asyncio
import io

import pytest
from envhub_helpers import Episodes, envhub, run
from PIL import Image as PILImage

from opentinker.game import AbstractGame, Image, StepResult
from opentinker.services.envhub.games.calculator import calculate
from opentinker.services.envhub.games.geometry_figures import geometry_problem


def tiny_png() -> bytes:
    out = io.BytesIO()
    PILImage.new("RGB", (1, 1)).save(out, "PNG")
    return out.getvalue()  # 69 bytes


TINY_PNG = tiny_png()


class Painter(AbstractGame):
    """Step action "<count> <bytes> <mime>": replies with that many images of that size: a
    1x1 PNG padded to the size when it fits (PNG readers ignore what follows the end chunk),
    else junk bytes."""

    uses_images = True

    def get_system_prompt(self) -> str:
        return ""

    def reset(self, *, seed: int = 0) -> str:
        return "paint"

    def step(self, action: str) -> StepResult:
        count, size, mime = action.split()
        n = int(size)
        data = TINY_PNG + b"\0" * (n - len(TINY_PNG)) if n >= len(TINY_PNG) else b"x" * n
        images = tuple(Image(data, mime) for _ in range(int(count)))
        return StepResult(observation="painted", reward=0.0, done=False, images=images)


@pytest.mark.integration
def test_geometry_figure_round_trips_through_envhub() -> None:
    async def scenario() -> None:
        async with envhub(builtin_envs=["geometry", "geometry_tools"]) as hub:
            episodes = Episodes(hub)
            spec = await episodes.open("geometry")
            assert spec.uses_images and spec.max_turns == 1
            await episodes.reset("g", seed=7)
            reset = (await episodes.recv()).reset.result
            want = geometry_problem(7)
            assert reset.observation == want.question
            assert [(i.data, i.mime_type) for i in reset.observation_images] == [
                (want.png, "image/png")
            ]
            figure = PILImage.open(io.BytesIO(reset.observation_images[0].data))
            assert figure.size == (112, 112)
            await episodes.step("g", f"It is \\boxed{{{want.answer}}}.")
            assert (await episodes.recv()).stepped.result.reward == 1.0
            tools = Episodes(hub)
            spec = await tools.open("geometry_tools")
            assert [t.name for t in spec.tools] == ["calculator"]

    run(scenario())


@pytest.mark.integration
def test_images_past_the_limits_fail_the_episode_naming_the_limit() -> None:
    async def scenario() -> None:
        async with envhub(max_observation_images=2, max_image_bytes=100) as hub:
            handle = await hub.serve(Painter, name="painter")
            try:
                cases = {
                    "2 100 image/png": None,  # at both limits: fine
                    "3 10 image/png": "3 images, more than max_observation_images (2)",
                    "1 101 image/png": "image 0 of 101 bytes, more than max_image_bytes (100)",
                    "1 10 image/gif": "image 0 has mime_type 'image/gif'",
                    "1 0 image/png": "image 0 is empty",
                    "1 60 image/png": "image 0 is not a readable image/png",  # junk bytes
                    "1 100 image/jpeg": "image 0 is PNG data labelled 'image/jpeg'",
                }
                episodes = Episodes(hub)
                await episodes.open("painter")
                for n, (action, problem) in enumerate(cases.items()):
                    await episodes.reset(f"e{n}")
                    await episodes.recv()
                    await episodes.step(f"e{n}", action)
                    reply = await episodes.recv()
                    if problem is None:
                        assert len(reply.stepped.result.observation_images) == 2
                        continue
                    assert (reply.failed.episode_id, reply.failed.code) == (f"e{n}", "INTERNAL")
                    assert f"Step replied with {problem}" in reply.failed.reason
            finally:
                await asyncio.to_thread(handle.stop)

    run(scenario())


@pytest.mark.unit
def test_calculator_evaluates_arithmetic_only() -> None:
    assert calculate("(3 + 4) * 2") == 14  # 7 * 2
    assert calculate("6*8/2") == 24  # 48 / 2
    for bad in ("__import__('os')", "2 ** 100", "1/0", "x"):
        with pytest.raises(ValueError):
            calculate(bad)


@pytest.mark.unit
def test_a_small_file_of_too_many_pixels_is_refused_before_anyone_decodes_it() -> None:
    from opentinker.envhub.v1 import environment_pb2
    from opentinker.services.envhub.image_limits import DEFAULT_IMAGE_LIMITS, image_problem

    out = io.BytesIO()
    PILImage.new("1", (4100, 4100)).save(out, "PNG")  # 1-bit black: compresses to a few KiB
    bomb = environment_pb2.ImagePart(data=out.getvalue(), mime_type="image/png")
    assert len(bomb.data) < DEFAULT_IMAGE_LIMITS.max_image_bytes  # the byte limit lets it in
    problem = image_problem([bomb], DEFAULT_IMAGE_LIMITS)
    assert problem is not None and "4100x4100 pixels" in problem, problem
