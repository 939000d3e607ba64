"""An environment written in Node.js (examples/node-env), registered with a real EnvHub.

The Node server loads our .proto files with @grpc/proto-loader and runs as a subprocess; EnvHub
runs in-process on 127.0.0.1:0. Episodes go through EnvHub's RunEpisodes stream: directly (a
binary search that must win with reward 1), and through the rollout's agent loop with the tiny
model, whose trajectories are checked against a replay of the game's rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from identity_helpers import user_channel, user_key
from rollout_helpers import tiny_engine

from opentinker.env_auth import ENV_TOKEN_METADATA_KEY
from opentinker.envhub.v1 import envhub_pb2 as hub_pb
from opentinker.envhub.v1 import envhub_pb2_grpc, environment_pb2_grpc
from opentinker.envhub.v1 import environment_pb2 as env_pb
from opentinker.errors import EnvironmentError_
from opentinker.services.envhub.server import EnvHubDeps, create_server
from opentinker.services.envhub.settings import EnvHubSettings
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.envs.envhub_client import EnvHubClient
from opentinker.services.rollout.types import FinishReason, Trajectory
from opentinker.services.worker.supervisor import with_parent_death_signal
from opentinker.spec import SamplingParams

pytestmark = pytest.mark.integration

NODE_ENV_DIR = Path(__file__).resolve().parents[2] / "examples" / "node-env"
ENV_NAME = "guess-number-node"
CAPACITY = 32
MAX_NUMBER = 100  # the game's defaults
MAX_GUESSES = 7


# --------------------------------------------------------------------------------------------
# Node, its packages, and the server process.


@pytest.fixture(scope="module")
def node_env_dir() -> Path:
    """examples/node-env with its npm packages installed (npm ci on a fresh clone)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        reason = "Node.js is not installed (need `node` and `npm` on PATH for examples/node-env)"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    if not (NODE_ENV_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        # Exactly the versions in package-lock.json; no install scripts are needed.
        done = subprocess.run(
            [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=NODE_ENV_DIR,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"npm ci in {NODE_ENV_DIR} failed:\n{done.stderr[-3000:]}"
    return NODE_ENV_DIR


class NodeEnvProcess:
    """`node server.js` registered with EnvHub; its JSON-line logs go to a file."""

    def __init__(self, env_dir: Path, envhub_address: str, log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("wb") as log_file:
            # No preexec_fn: forking Python code out of a process running gRPC threads (this
            # one runs a scheduler for the whole session) can crash the child. The shim asks
            # the kernel to kill node if the test process dies, then execs it.
            self.process = subprocess.Popen(
                with_parent_death_signal(
                    [
                        "node",
                        "server.js",
                        f"--envhub={envhub_address}",
                        "--port=0",
                        f"--name={ENV_NAME}",
                        f"--capacity={CAPACITY}",
                    ]
                ),
                cwd=env_dir,
                stdout=subprocess.DEVNULL,
                stderr=log_file,
            )

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 5 s; returns the exit code. Never leaves an orphan."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        return self.process.returncode


@dataclass
class Mesh:
    envhub_address: str
    stub: envhub_pb2_grpc.EnvHubServiceStub
    node: NodeEnvProcess
    deps: EnvHubDeps

    def address_of(self, instance_id: str) -> str:
        """EnvHub's own record of an instance's address (ListEnvironments shows it to admins
        only)."""
        [found] = [i for i in self.deps.registry.instances() if i.instance_id == instance_id]
        return found.address

    async def instances(self) -> list[hub_pb.EnvironmentInstance]:
        reply = await self.stub.ListEnvironments(hub_pb.ListEnvironmentsRequest(), timeout=5)
        return [i for i in reply.instances if i.env_name == ENV_NAME]

    async def wait_registered(self, *, other_than: str = "") -> hub_pb.EnvironmentInstance:
        """The Node server's registration (one whose id is not ``other_than``), within 20 s."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.node.process.poll() is None, f"node exited early:\n{self.node.logs()}"
            found = [i for i in await self.instances() if i.instance_id != other_than]
            if found:
                return found[0]
            await asyncio.sleep(0.05)
        raise AssertionError(f"the Node env never registered with EnvHub:\n{self.node.logs()}")


@contextlib.asynccontextmanager
async def node_env_mesh(env_dir: Path, tmp_path: Path) -> AsyncIterator[Mesh]:
    """A real EnvHub (no built-in envs) and the Node env server registered with it."""
    settings = EnvHubSettings(
        port=0, builtin_envs=[], renew_interval_s=0.3, registration_ttl_s=3.0, env_call_timeout_s=5
    )
    deps = EnvHubDeps.create(settings)
    server, port = await create_server(settings, deps)
    address = f"127.0.0.1:{port}"
    node = NodeEnvProcess(env_dir, address, tmp_path / "node-env.log")
    try:
        async with user_channel(address) as channel:
            mesh = Mesh(address, envhub_pb2_grpc.EnvHubServiceStub(channel), node, deps)
            await mesh.wait_registered()
            yield mesh
    finally:
        node.stop()
        assert node.process.poll() is not None, "the node server survived"
        await server.stop(0)
        await deps.close()


def run(coro) -> None:  # noqa: ANN001 - a coroutine
    asyncio.run(asyncio.wait_for(coro, 90))


# --------------------------------------------------------------------------------------------
# The game's rules, as the test knows them.


def first_number(text: str) -> int | None:
    match = re.search(r"[0-9]+", text)
    return None if match is None else int(match.group())


async def find_secret(client: EnvHubClient, episode_id: str, seed: int) -> tuple[int, int]:
    """Binary search an episode to its win; returns (secret, guesses). Asserts every reply."""
    low, high = 1, MAX_NUMBER
    session = client.session(episode_id)
    reset = await session.reset(seed, {})
    assert f"between 1 and {MAX_NUMBER}" in reset.observation
    assert "higher or lower" in reset.system_prompt
    for guesses in range(1, MAX_GUESSES + 1):
        guess = (low + high) // 2
        outcome = await session.step(f"My guess is {guess}.")
        assert outcome.info["guesses"] == str(guesses)
        if outcome.done:
            assert outcome.reward == 1.0, outcome
            assert outcome.info["outcome"] == "win" and outcome.info["secret"] == str(guess)
            await session.close()
            return guess, guesses
        assert outcome.reward == 0.0
        left = MAX_GUESSES - guesses
        if "too low. Guess higher." in outcome.observation:
            low = guess + 1
        else:
            assert "too high. Guess lower." in outcome.observation, outcome.observation
            high = guess - 1
        assert f"{left} guess" in outcome.observation
    raise AssertionError(f"binary search of 1..{MAX_NUMBER} must win within {MAX_GUESSES}")


# --------------------------------------------------------------------------------------------
# Tests.


def test_node_env_refuses_calls_without_its_env_token(node_env_dir: Path, tmp_path: Path) -> None:
    """The example enforces the contract of environment.proto ("Authentication"): only the
    EnvHub it registered with, presenting its env token, gets an answer."""

    def direct(address: str, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
        with grpc.insecure_channel(address) as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            try:
                stub.Reset(
                    env_pb.ResetRequest(episode_id="x", seed=1), timeout=5, metadata=metadata
                )
            except grpc.RpcError as err:
                assert ENV_TOKEN_METADATA_KEY in err.details() and "EnvHub" in err.details()
                return err.code()
            return grpc.StatusCode.OK

    async def scenario() -> None:
        async with node_env_mesh(node_env_dir, tmp_path) as mesh:
            [instance] = mesh.deps.registry.instances(ENV_NAME)
            token = instance.env_token
            assert len(token) == 64  # 32 random bytes, hex
            wrong = token[:-1] + ("0" if token[-1] != "0" else "1")
            for metadata in (
                (),
                ((ENV_TOKEN_METADATA_KEY, wrong),),
                ((ENV_TOKEN_METADATA_KEY, token), (ENV_TOKEN_METADATA_KEY, token)),
            ):
                code = await asyncio.to_thread(direct, instance.address, metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED, metadata
            # What EnvHub presents is answered.
            presented = ((ENV_TOKEN_METADATA_KEY, token),)
            assert await asyncio.to_thread(direct, instance.address, presented) == (
                grpc.StatusCode.OK
            )
            logs = mesh.node.logs()
            assert logs.count("env_call_refused") == 3 and token not in logs

    run(scenario())


def test_node_env_registers_and_a_correct_guess_wins(node_env_dir: Path, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node_env_mesh(node_env_dir, tmp_path) as mesh:
            [instance] = await mesh.instances()
            assert instance.address == "" and instance.capacity == CAPACITY  # admins see it
            assert mesh.address_of(instance.instance_id).startswith("127.0.0.1:")
            async with EnvHubClient(
                mesh.envhub_address,
                credential=user_key(),
                job_id="job-node",
                env_name=ENV_NAME,
                timeout_s=10,
            ) as client:
                assert client.spec is not None
                assert (client.spec.name, client.spec.max_turns) == (ENV_NAME, MAX_GUESSES)
                # Ten episodes at once on one stream, interleaved on the one Node process.
                seeds = list(range(10))
                found = await asyncio.gather(
                    *(find_secret(client, f"search-{seed}", seed) for seed in seeds)
                )
                secrets = [secret for secret, _ in found]
                assert len(set(secrets)) > 3, f"seeds should pick different numbers: {secrets}"

                # Same seed, same secret: the known answer wins at once with reward 1.
                winner = client.session("known-answer")
                await winner.reset(seeds[3], {})
                outcome = await winner.step(f"{secrets[3]}")
                assert (outcome.reward, outcome.done, outcome.info["outcome"]) == (1.0, True, "win")
                await winner.close()

                # A reply without a number uses a guess; running out loses with reward 0.
                loser = client.session("no-number")
                await loser.reset(5, {"max_guesses": "2", "max_number": "10"})
                first = await loser.step("no idea")
                assert (first.reward, first.done) == (0.0, False)
                assert "no number" in first.observation and "1 guess left" in first.observation
                last = await loser.step("still none")
                assert (last.reward, last.done, last.info["outcome"]) == (0.0, True, "loss")
                await loser.close()

                # Bad options: the env's INVALID_ARGUMENT reaches the rollout with its message.
                with pytest.raises(EnvironmentError_, match="max_number") as info:
                    await client.session("bad").reset(1, {"max_number": "lots"})
                assert info.value.code == "INVALID_ARGUMENT"
            assert "episode_dropped_idle" not in mesh.node.logs()

    run(scenario())


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TransformersEngine:
    return tiny_engine(tmp_path_factory)


def split_turns(t: Trajectory) -> list[tuple[int, list[int]]]:
    """The completion as runs of (loss mask, token ids)."""
    runs: list[tuple[int, list[int]]] = []
    completion = t.token_ids[t.prompt_length :]
    for token, mask in zip(completion, t.loss_mask, strict=True):
        if not runs or runs[-1][0] != mask:
            runs.append((mask, []))
        runs[-1][1].append(token)
    return runs


def replay(
    t: Trajectory, engine: TransformersEngine, secret: int, *, max_guesses: int, max_turns: int
) -> None:
    """Check a trajectory against the game's rules: reward, turns, finish reason, observations."""
    runs = split_turns(t)
    actions = [engine.tokenizer.decode(ids, skip_special_tokens=True) for m, ids in runs if m]
    observations = [engine.tokenizer.decode(ids) for m, ids in runs if not m]
    assert len(actions) == t.num_turns >= 1
    assert len(observations) == t.num_turns - 1  # no observation after the last turn
    won = any(first_number(a) == secret for a in actions)
    assert t.reward == (1.0 if won else 0.0)
    if won or t.num_turns == max_guesses:
        assert t.finish_reason is FinishReason.ENV_DONE, t.finish_detail
    else:
        assert (t.finish_reason, t.num_turns) == (FinishReason.MAX_TURNS, max_turns)
    for n, (action, observation) in enumerate(zip(actions, observations, strict=False), 1):
        guess = first_number(action)
        if guess is None:
            expected = "I found no number in your reply."
        else:
            expected = f"{guess} is too {'low' if guess < secret else 'high'}."
        assert expected in observation, (action, observation)
        assert f"{max_guesses - n} guess" in observation


def test_rollout_plays_the_node_env(
    node_env_dir: Path, tmp_path: Path, engine: TransformersEngine
) -> None:
    async def scenario() -> None:
        async with node_env_mesh(node_env_dir, tmp_path) as mesh:
            async with EnvHubClient(
                mesh.envhub_address,
                credential=user_key(),
                job_id="job-rollout",
                env_name=ENV_NAME,
                timeout_s=10,
            ) as client:
                seeds = [11, 12, 13]
                secrets = {
                    seed: (await find_secret(client, f"probe-{seed}", seed))[0] for seed in seeds
                }
                # (env options, loop turn budget): the env ends episodes; the loop's budget does.
                for run_index, (options, max_turns) in enumerate(
                    [({"max_guesses": "2"}, 3), ({}, 2)]
                ):
                    max_guesses = int(options.get("max_guesses", MAX_GUESSES))
                    trajectories = await play(
                        client, engine, seeds, options, max_turns=max_turns, run_index=run_index
                    )
                    assert len(trajectories) == 2 * len(seeds)
                    for t, seed in zip(
                        trajectories, [s for s in seeds for _ in (0, 1)], strict=True
                    ):
                        assert t.episode_id.startswith(f"run{run_index}-seed{seed}-")
                        assert (
                            len(t.loss_mask)
                            == len(t.logprobs)
                            == len(t.token_ids) - t.prompt_length
                        )
                        assert sum(t.loss_mask) > 0
                        for logprob, mask in zip(t.logprobs, t.loss_mask, strict=True):
                            assert logprob < 0 if mask else logprob == 0.0
                        replay(
                            t, engine, secrets[seed], max_guesses=max_guesses, max_turns=max_turns
                        )
                    reasons = {t.finish_reason for t in trajectories}
                    expected = FinishReason.ENV_DONE if run_index == 0 else FinishReason.MAX_TURNS
                    assert expected in reasons, [(t.finish_reason, t.reward) for t in trajectories]
            # Every episode was closed on the Node server: its slots are free again.
            [instance] = await mesh.instances()
            assert instance.active_episodes == 0

    run(scenario())


async def play(
    client: EnvHubClient,
    engine: TransformersEngine,
    seeds: list[int],
    options: Mapping[str, str],
    *,
    max_turns: int,
    run_index: int,
) -> list[Trajectory]:
    """Two episodes (one GRPO group) per seed through the agent loop."""
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8),
        max_turns=max_turns,
        max_episode_tokens=1024,
        env_options=dict(options),
    )
    ids = [
        (f"run{run_index}-seed{seed}-{sample}", group, seed)
        for group, seed in enumerate(seeds)
        for sample in (0, 1)
    ]
    requests = [EpisodeRequest(eid, group, seed, client.session(eid)) for eid, group, seed in ids]
    trajectories, stats = await AgentLoop(engine, config).run(requests, seed=run_index)
    assert stats.generated_tokens == sum(sum(t.loss_mask) for t in trajectories) > 0
    return trajectories


def test_node_env_registers_again_and_deregisters_on_sigterm(
    node_env_dir: Path, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with node_env_mesh(node_env_dir, tmp_path) as mesh:
            [first] = await mesh.instances()
            [record] = mesh.deps.registry.instances(ENV_NAME)
            # EnvHub forgets it (as after an EnvHub restart): the next renewal is answered
            # NOT_FOUND and the server registers again, with the same env token.
            await mesh.stub.DeregisterEnvironment(
                hub_pb.DeregisterEnvironmentRequest(instance_id=first.instance_id), timeout=5
            )
            again = await mesh.wait_registered(other_than=first.instance_id)
            [record_again] = mesh.deps.registry.instances(ENV_NAME)
            assert record_again.instance_id == again.instance_id
            assert (record_again.address, record_again.env_token) == (
                record.address,
                record.env_token,
            )
            assert "registration_lost_registering_again" in mesh.node.logs()

            started = time.monotonic()
            mesh.node.process.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(mesh.node.process.wait, 5)
            took = time.monotonic() - started
            assert code == 0, mesh.node.logs()
            # Gone at once, well before the 3 s TTL could have dropped it.
            assert took < 2.5 and await mesh.instances() == [], mesh.node.logs()
            assert '"event":"deregistered"' in mesh.node.logs()

    run(scenario())
