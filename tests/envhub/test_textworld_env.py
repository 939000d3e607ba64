"""The ``textworld`` household environment: layouts chosen by seed (unit), and real TextWorld
games generated here into a cache, then played: the walkthrough wins, the turn limit loses, the
cache is reused, and the served env answers over gRPC."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from opentinker.env_server import serve
from opentinker.envhub.v1 import environment_pb2 as pb
from opentinker.envhub.v1 import environment_pb2_grpc
from opentinker.services.envhub.games.textworld_env import HouseholdGame, parse_command
from opentinker.services.envhub.games.textworld_games import game_path, make_layout

SEED = 11


@pytest.mark.unit
def test_a_seed_fixes_the_layout_and_its_walkthrough() -> None:
    layout = make_layout(SEED, rooms=3, distractors=4)
    assert layout == make_layout(SEED, rooms=3, distractors=4)
    assert any(make_layout(s, rooms=3, distractors=4) != layout for s in range(SEED + 1, SEED + 4))
    assert len(layout.rooms) == 3 and len(layout.objects) == 5
    assert len({name for name, _ in layout.objects}) == 5  # no object twice
    walkthrough = layout.walkthrough
    destination = layout.receptacle(layout.destination)
    verb = "insert" if destination.container else "put"
    assert walkthrough[-1].startswith(f"{verb} {layout.target} ")
    assert any(c.startswith(f"take {layout.target} from ") for c in walkthrough)
    assert layout.task.startswith(f"put the {layout.target} ")
    with pytest.raises(ValueError, match="rooms"):
        make_layout(SEED, rooms=9)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("reply", "command"),
    [
        ("go east", "go east"),
        ("I should look first.\n\nAction: Look.", "look"),
        ("> `open fridge`", "open fridge"),
        ("Command:  take   mug from  countertop ", "take mug from countertop"),
        ("   \n  ", ""),
    ],
)
def test_parse_command(reply: str, command: str) -> None:
    assert parse_command(reply) == command


textworld = pytest.importorskip("textworld", reason="the textworld package is not installed")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache holding the game of SEED, built by the real generator worker."""
    folder = tmp_path_factory.mktemp("textworld")
    game = HouseholdGame(cache_dir=folder)
    game.reset(seed=SEED)  # builds it (seconds)
    game.close()
    yield folder
    HouseholdGame.generator.close()


@pytest.mark.integration
def test_the_walkthrough_wins(cache_dir: Path) -> None:
    layout = make_layout(SEED)
    game = HouseholdGame(cache_dir=cache_dir)
    first = game.reset(seed=SEED)
    assert first.startswith(f"Your task is to: {layout.task}.")
    assert "Admissible commands:\n- " in first and "- look" in first
    try:
        *moves, last = layout.walkthrough
        for command in moves:
            stepped = game.step(f"Next I will do this.\n{command}")
            assert (stepped.reward, stepped.done, stepped.info["outcome"]) == (
                0.0,
                False,
                "ongoing",
            )
            assert "Admissible commands:" in stepped.observation
        taken = f"take {layout.target} from"
        assert any(taken in c for c in [*moves, last])
        final = game.step(last)
        assert (final.reward, final.done, final.info["outcome"]) == (1.0, True, "win")
        assert "Task complete." in final.observation and ">" not in final.observation
        assert final.info["turns"] == str(len(layout.walkthrough))
    finally:
        game.close()


@pytest.mark.integration
def test_wrong_commands_keep_going_until_the_turn_limit_loses(cache_dir: Path) -> None:
    game = HouseholdGame(cache_dir=cache_dir)
    game.reset(seed=SEED, max_turns="3")
    try:
        unknown = game.step("xyzzy")
        assert "not a verb I recognise" in unknown.observation and not unknown.done
        empty = game.step("   ")
        assert "No command found" in empty.observation and not empty.done
        last = game.step("look")
        assert (last.reward, last.done, last.info["outcome"]) == (0.0, True, "loss")
        assert "Turn limit reached (3)" in last.observation
    finally:
        game.close()


@pytest.mark.integration
def test_games_are_cached_and_shared_by_seed(cache_dir: Path) -> None:
    built = game_path(cache_dir, SEED, rooms=2, distractors=3)
    stamp = built.stat().st_mtime_ns
    game = HouseholdGame(cache_dir=cache_dir)
    started = time.monotonic()
    game.reset(seed=SEED + 100, games="100")  # (11 + 100) % 100 = 11: the same game
    took = time.monotonic() - started
    game.close()
    assert game.game_file == built and built.stat().st_mtime_ns == stamp  # not rebuilt
    assert took < 3.0, f"a cached game took {took:.1f} s to start"
    assert built.with_suffix(".json").exists()
    assert [p.name for p in cache_dir.iterdir() if p.name.startswith(".building")] == []


@pytest.mark.integration
def test_bad_options_and_a_failing_build_are_clear_errors(cache_dir: Path) -> None:
    game = HouseholdGame(cache_dir=cache_dir)
    with pytest.raises(ValueError) as info:
        game.reset(seed=SEED, rooms="7", games="-1")
    assert "rooms" in str(info.value) and "games" in str(info.value)
    blocked = cache_dir / "not-a-folder"
    blocked.write_text("a file where the cache folder should be")
    with pytest.raises(RuntimeError, match=r"building the TextWorld game \(seed 5\) failed"):
        HouseholdGame(cache_dir=blocked).reset(seed=5)


@pytest.mark.integration
def test_served_over_grpc(cache_dir: Path) -> None:
    handle = serve(lambda: HouseholdGame(cache_dir=cache_dir), block=False)
    try:
        with handle.channel() as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            spec = stub.GetEnvironmentSpec(pb.GetEnvironmentSpecRequest(), timeout=5).spec
            reset = stub.Reset(pb.ResetRequest(episode_id="e", seed=SEED), timeout=10)
            stepped = stub.Step(pb.StepRequest(episode_id="e", action="look"), timeout=10)
    finally:
        handle.stop(grace_s=0)
    assert (spec.name, spec.max_turns) == ("textworld", 30)
    assert "one command" in reset.system_prompt and "Your task is to:" in reset.observation
    assert not stepped.done and "Admissible commands:" in stepped.observation
    assert len(handle.table) == 0  # stopped: the episode's game was closed
