"""Env trouble is visible and bounded (issue 34): every RL step reports its env errors (how
many, their share, their kinds, the first reason) and a job whose env error share passes
RlConfig.max_env_error_fraction over its window fails naming the env and the reasons.

The pure parts by hand; the loop against the real mesh (trainer_loop_helpers.py) with
``flaky``, an SDK game served for real that fails every 4th episode, in turn by raising, by a
NaN reward and by an oversized observation (25% of the episodes).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path

import pytest
from identity_service import Identities
from trainer_loop_helpers import job_spec, mesh, run_loop

from opentinker.env_server import serve
from opentinker.game import AbstractGame, StepResult
from opentinker.services.common.env_errors import (
    EnvErrorWindow,
    env_error_kind,
    env_error_metrics,
    tally,
)
from opentinker.services.trainer.rl.loop import Outcome
from opentinker.spec import JobSpec, from_proto, to_proto


def test_reasons_the_rollout_records_sort_into_kinds() -> None:
    assert env_error_kind("bad reply to step 1: the step reply has a non-finite reward (nan)") == (
        "bad_reward"
    )
    assert env_error_kind("bad reply to step 1: the step observation has 20000 characters, "
                          "more than max_observation_chars=16384") == "oversized"  # fmt: skip
    assert env_error_kind("step 1 failed: DEADLINE_EXCEEDED: env 'x' took 30 s") == "timeout"
    assert env_error_kind("episode 'e': Step did not answer within 10 s") == "timeout"
    assert env_error_kind("refused reset (CAPACITY_REACHED): ... --capacity 1") == "capacity"
    assert env_error_kind("reset failed: environment 'x' is not registered") == "unreachable"
    assert env_error_kind("bad reset reply: ... (missing fields)") == "bad_reply"
    assert env_error_kind("step 2 failed: INTERNAL: ZeroDivisionError: division by zero") == (
        "raise"
    )


def test_a_tally_counts_kinds_and_keeps_the_first_reason() -> None:
    t = tally(["step 1 failed: boom", "bad reply to step 1: non-finite reward (nan)"], 8)
    assert (t.errors, t.episodes, t.first_reason) == (2, 8, "step 1 failed: boom")
    m = env_error_metrics(t)
    assert m["env_errors"] == 2.0 and m["env_error_frac"] == 0.25  # 2 / 8
    assert m["env_errors/raise"] == 1.0 and m["env_errors/bad_reward"] == 1.0
    assert m["env_errors/timeout"] == 0.0  # every kind, from the first step on


def test_the_window_fails_only_when_full_and_over_the_fraction() -> None:
    w = EnvErrorWindow(env_name="flaky", max_fraction=0.2, window=3)
    assert w.add(tally(["step 1 failed: boom"] * 4, 8)) == ""  # 50%, but one step of three
    assert w.add(tally([], 8)) == ""
    reason = w.add(tally([], 8))  # 4 of 24 = 17%: under 0.2
    assert reason == ""
    reason = w.add(tally(["step 1 failed: boom", "step 1 failed: bang"], 8))  # 6 of 24 = 25%
    assert reason == ""  # the first step left the window: 2 of 24
    short = EnvErrorWindow(env_name="flaky", max_fraction=0.2, window=5)
    reason = short.add(tally(["step 1 failed: boom", "x DEADLINE_EXCEEDED"], 8), final=True)
    assert "env 'flaky' failed 2 of 8 episodes (25%)" in reason
    assert "max_env_error_fraction=0.2" in reason and "first: step 1 failed: boom" in reason
    assert "raise 1" in reason and "timeout 1" in reason
    with pytest.raises(ValueError, match="window"):
        EnvErrorWindow(env_name="x", max_fraction=0.2, window=0)


def test_the_bound_travels_with_the_spec_and_bad_values_name_the_field(
    tiny_model_dir: Path,
) -> None:
    spec = job_spec(tiny_model_dir, max_env_error_fraction=0.5, env_error_window=4)
    back = from_proto(to_proto(spec))
    assert back.rl is not None
    assert (back.rl.max_env_error_fraction, back.rl.env_error_window) == (0.5, 4)
    default = from_proto(to_proto(job_spec(tiny_model_dir)))
    assert default.rl is not None and default.rl.max_env_error_fraction == 0.2
    with pytest.raises(ValueError, match="max_env_error_fraction"):
        job_spec(tiny_model_dir, max_env_error_fraction=1.5)
    with pytest.raises(ValueError, match="env_error_window"):
        job_spec(tiny_model_dir, env_error_window=0)
    from opentinker.spec import InferenceConfig, ModelSpec

    infer = JobSpec(
        kind="inference",
        model=ModelSpec(base_model=str(tiny_model_dir), finetune="full"),
        inference=InferenceConfig(env_name="letter", max_env_error_fraction=0.5),
    )
    back_infer = from_proto(to_proto(infer)).inference
    assert back_infer is not None and back_infer.max_env_error_fraction == 0.5
    with pytest.raises(ValueError, match="max_env_error_fraction"):
        InferenceConfig(env_name="letter", max_env_error_fraction=-0.1)


class Flaky(AbstractGame):
    """Every 4th episode fails at its step: it raises, replies a NaN reward, or an oversized
    observation, in turn; the others end with reward 1 for an answer starting with 'a'."""

    name = "flaky"
    played = itertools.count()

    def get_system_prompt(self) -> str:
        return "Say a letter."

    def reset(self, *, seed: int = 0) -> str:
        self.n = next(Flaky.played)
        return "Letter?"

    def step(self, action: str) -> StepResult:
        if self.n % 4 == 3:
            kind = (self.n // 4) % 3
            if kind == 0:
                raise RuntimeError(f"flaky fell over in episode {self.n}")
            if kind == 1:
                return StepResult("ok", math.nan, True)
            return StepResult("x" * 200_000, 0.0, False)
        return StepResult("", float(action.strip().startswith("a")), True)


@pytest.fixture(scope="module")
def tiny_model_dir(letter_model_dir: Path) -> Path:
    return letter_model_dir


async def run_flaky(  # noqa: ANN201
    identities: Identities, spec: JobSpec, tmp_path: Path, game: type[AbstractGame] = Flaky
):
    """The RL loop of ``spec`` on the mesh with ``game`` served; (outcome, the scheduler)."""
    async with mesh(identities) as m:
        handle = await asyncio.to_thread(serve, game, envhub_address=m.envhub_address, block=False)
        try:
            outcome, _, _ = await run_loop(m, spec, tmp_path)
        finally:
            handle.stop()
        return outcome, m.scheduler


def test_each_step_reports_its_env_errors_kinds_and_first_reason(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = job_spec(tiny_model_dir, env_name="flaky", env_options={}, steps=2,
                    max_env_error_fraction=0.5, env_error_window=2)  # fmt: skip
    outcome, scheduler = asyncio.run(run_flaky(identities, spec, tmp_path))
    assert outcome is Outcome.SUCCEEDED, scheduler.of("failure")
    steps = scheduler.of("step")
    assert len(steps) == 2
    kinds = {"raise": 0.0, "bad_reward": 0.0, "oversized": 0.0}
    for s in steps:  # 8 episodes a step, every 4th failed: 2
        assert s.metrics["env_errors"] == 2.0 and s.metrics["env_error_frac"] == 0.25
        assert sum(s.metrics[f"env_errors/{k}"] for k in kinds) == 2.0, s.metrics
        for k in kinds:
            kinds[k] += s.metrics[f"env_errors/{k}"]
    assert all(n >= 1 for n in kinds.values()), kinds  # 4 failures: the 3 ways in turn
    # Each step's first reason travels in its StepMetrics (env_error_reason), as recorded.
    ways = ("flaky fell over in episode", "non-finite", "max_observation_chars")
    for s in steps:
        assert any(way in s.env_error_reason for way in ways), s.env_error_reason
    lines = [log.message for log in scheduler.of("log")]
    assert any(line.startswith("env 'flaky': 2 of 8 episodes failed in step 1") for line in lines)
    assert any("first: " in line and "flaky fell over in episode" in line for line in lines)


def test_a_job_over_its_env_error_fraction_fails_naming_env_and_reasons(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = job_spec(tiny_model_dir, env_name="flaky", env_options={}, steps=3,
                    env_error_window=2)  # fmt: skip  # default max_env_error_fraction 0.2
    outcome, scheduler = asyncio.run(run_flaky(identities, spec, tmp_path))
    assert outcome is Outcome.FAILED
    (failure,) = scheduler.of("failure")
    assert "env 'flaky' failed 4 of 16 episodes (25%) over the last 2 steps" in failure.reason
    assert "max_env_error_fraction=0.2" in failure.reason
    assert "flaky fell over in episode" in failure.reason
    # judged once the window of 2 steps was full: both steps' figures were reported first
    assert [s.step for s in scheduler.of("step")] == [1, 2]


def test_tail_shows_env_errors_with_the_first_reason_and_an_inference_job_as_one() -> None:
    from rich.console import Console

    from opentinker.console import format_event
    from opentinker.jobs import JobEvent
    from opentinker.live_view import TailView

    def text(view: TailView) -> str:
        console = Console(width=200, record=True)
        console.print(view.render())
        return console.export_text()

    step = JobEvent(1, 0.0, "step", step=1, metrics={"episodes": 6.0, "env_errors": 2.0,
                                                      "env_error_frac": 0.25})  # fmt: skip
    assert "env errors 2 (25%)" in format_event(step)
    line = "env 'flaky': 2 of 8 episodes failed in step 1 (raise 2); first: step 1 failed: boom"
    rl = TailView(job_id="j1", step_budget=3, kind="RL")
    for event in (step, JobEvent(2, 0.0, "log", message=line)):
        rl.update(event)
    assert f"env errors 2 (25%) — first: {line}" in text(rl)

    infer = TailView(job_id="j2", step_budget=0, kind="INFERENCE")
    rows = [{"finish_reason": "ENV_DONE"}] + [
        {"finish_reason": "ENV_ERROR", "finish_detail": f"reset failed: boom {i}"} for i in range(7)
    ]
    for i, row in enumerate(rows):
        infer.update(JobEvent(i + 1, 0.0, "row", row=row))
    shown = text(infer)
    assert "episodes 1 done / 7 failed" in shown and "first: reset failed: boom 0" in shown
    assert "ETA" not in shown and "step" not in shown


class MostlyBroken(AbstractGame):
    """Only the first episode of each 8 it plays ends well; the others raise at their step."""

    name = "mostly-broken"
    played = itertools.count()

    def get_system_prompt(self) -> str:
        return "Say a letter."

    def reset(self, *, seed: int = 0) -> str:
        self.n = next(MostlyBroken.played)
        return "Letter?"

    def step(self, action: str) -> StepResult:
        if self.n % 8:
            raise ConnectionError(f"backend of episode {self.n} is down")
        return StepResult("", 1.0, True)


def test_an_inference_job_with_most_episodes_failed_fails_naming_the_reasons(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from opentinker.services.common.grpc_server import aio_channel
    from opentinker.services.trainer.reporter import SchedulerReporter
    from opentinker.services.trainer.rl.inference_job import InferenceJob
    from opentinker.services.trainer.rollout_link.rollout_client import GrpcRolloutSession
    from opentinker.services.trainer.settings import TrainerSettings
    from opentinker.spec import InferenceConfig, ModelSpec, SamplingParams

    spec = JobSpec(
        kind="inference",
        model=ModelSpec(base_model=str(tiny_model_dir), finetune="full"),
        inference=InferenceConfig(
            env_name="mostly-broken",
            episodes=8,
            concurrency=8,
            sampling=SamplingParams(max_new_tokens=2),
        ),
    )

    async def scenario():  # noqa: ANN202
        async with mesh(identities) as m:
            handle = await asyncio.to_thread(
                serve, MostlyBroken, envhub_address=m.envhub_address, block=False
            )
            try:
                async with (
                    aio_channel(m.rollout_address, credential=m.job_token) as rc,
                    aio_channel(m.scheduler_address) as sc,
                ):
                    job = InferenceJob(
                        job_id=m.job_id,
                        spec=spec,
                        rollout=GrpcRolloutSession(rc, address=m.rollout_address),
                        reporter=SchedulerReporter(
                            sc,
                            address=m.scheduler_address,
                            job_id=m.job_id,
                            attempt=1,
                            timeout_s=5,
                        ),  # fmt: skip
                        settings=TrainerSettings(collect_timeout_s=60, open_timeout_s=60),
                    )
                    return await job.run(), m.scheduler
            finally:
                handle.stop()

    outcome, scheduler = asyncio.run(scenario())
    assert outcome is Outcome.FAILED
    rows = scheduler.of("row")
    assert len(rows) == 8  # every episode reported, done or failed
    (failure,) = scheduler.of("failure")
    assert "env 'mostly-broken' failed 7 of 8 episodes (88%) in all" in failure.reason
    assert "max_env_error_fraction=0.2" in failure.reason and "raise 7" in failure.reason
    assert "backend of episode" in failure.reason and "is down" in failure.reason
    (line,) = [log.message for log in scheduler.of("log") if log.message.startswith("env '")]
    assert line.startswith("env 'mostly-broken': 7 of 8 episodes failed in batch 1 (raise 7)")


def test_an_env_whose_server_died_is_named_with_its_address_and_last_error() -> None:
    """EnvHub keeps the last dead instance of an env (dropped as dead, or its renewals
    stopped) until one registers again: NOT_FOUND then names it, not 'no env named'."""
    from opentinker.env_auth import new_env_token
    from opentinker.errors import NotFoundError
    from opentinker.services.envhub.registry import InMemoryRegistry, not_registered

    now = [0.0]
    registry = InMemoryRegistry(ttl_s=10, clock=lambda: now[0])
    dead = registry.register("bad", "127.0.0.1:4321", 4, env_token=new_env_token())
    registry.deregister(dead.instance_id, why="last error: Step failed: UNAVAILABLE: refused")
    err = not_registered(registry, "bad", "acme")
    assert err.reason == "ENV_SERVER_DIED"
    assert "environment 'bad' has no live instance: its server at 127.0.0.1:4321 died" in str(err)
    assert "last error: Step failed: UNAVAILABLE: refused" in str(err)
    with pytest.raises(NotFoundError, match="127.0.0.1:4321"):
        registry.acquire("bad", tenant="acme")
    registry.register("bad", "127.0.0.1:4321", 4, env_token=new_env_token())  # it came back
    assert registry.departed("bad") is None
    now[0] = 11.0  # its renewals stopped
    assert "stopped renewing its registration for 10 s" in str(not_registered(registry, "bad", ""))
    assert not_registered(registry, "other", "").reason == "ENV_NOT_FOUND"


def test_a_stream_waits_a_grace_period_for_a_dead_env_server_to_register_again() -> None:
    """The env's only server died (EnvHub dropped it); a job opening it within
    env_return_grace_s waits, and goes on once the server (restarted) registers again."""
    import time as clock

    from envhub_helpers import Episodes, SlowGame, envhub

    async def scenario() -> None:
        async with envhub(env_return_grace_s=10.0) as hub:
            first = await hub.serve(SlowGame)
            (instance,) = await hub.instances("slow")
            first.stop()
            hub.deps.registry.deregister(instance.instance_id, why="last error: it was killed")
            started = clock.monotonic()
            opening = asyncio.create_task(Episodes(hub).open("slow"))
            await asyncio.sleep(1.0)
            assert not opening.done()  # waiting for it, not failing at once
            again = await hub.serve(SlowGame)
            try:
                spec = await asyncio.wait_for(opening, 10)
                assert spec.name == "slow" and clock.monotonic() - started < 8
            finally:
                again.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


class Seedless(AbstractGame):
    """Ignores the seed Reset gives it: every episode gets a prompt of its own."""

    name = "seedless"
    played = itertools.count()

    def get_system_prompt(self) -> str:
        return "Say a letter."

    def reset(self, *, seed: int = 0) -> str:
        return f"Letter number {next(Seedless.played) % 7}?"

    def step(self, action: str) -> StepResult:
        return StepResult("", float(action.strip().startswith("a")), True)


def test_a_grpo_group_given_different_prompts_is_counted_and_told(
    identities: Identities, tiny_model_dir: Path, tmp_path: Path
) -> None:
    spec = job_spec(tiny_model_dir, env_name="seedless", env_options={}, steps=2)

    outcome, scheduler = asyncio.run(run_flaky(identities, spec, tmp_path, Seedless))
    assert outcome is Outcome.SUCCEEDED, scheduler.of("failure")
    steps = scheduler.of("step")
    assert [s.metrics["groups_prompt_mismatch"] for s in steps] == [2.0, 2.0]  # both groups
    told = [log.message for log in scheduler.of("log") if "different prompts" in log.message]
    assert len(told) == 1  # once per job
    assert told[0].startswith("env 'seedless': 2 GRPO group(s) of step 1 got different prompts")
    assert "ignore the seed" in told[0]


def test_an_env_that_keeps_its_seed_has_no_mixed_groups() -> None:
    from opentinker.services.trainer.rl.batch import Episode
    from opentinker.services.trainer.rl.env_error_watch import mixed_prompt_groups

    def ep(group: int, prompt: list[int], role: str = "") -> Episode:
        return Episode(group, 0, [*prompt, 9], len(prompt), [0.0], [1], 0.0, False, role=role)

    same = [ep(0, [1, 2]), ep(0, [1, 2]), ep(1, [3]), ep(1, [3])]
    assert mixed_prompt_groups(same) == []
    assert mixed_prompt_groups([*same, ep(1, [4])]) == [1]
    assert mixed_prompt_groups([ep(0, [1], "white"), ep(0, [2], "black")]) == []  # roles differ


def test_tail_and_console_show_the_first_reason_from_the_step_metric() -> None:
    from rich.console import Console

    from opentinker.common.v1 import common_pb2
    from opentinker.console import format_event
    from opentinker.jobs import JobEvent
    from opentinker.live_view import TailView

    reason = "environment 'flaky' raised: [out] of cheese"  # brackets: not rich markup
    wire = common_pb2.JobEvent(seq=1, step=common_pb2.StepMetrics(step=1, env_error_reason=reason,
        metrics={"episodes": 6.0, "env_errors": 2.0, "env_error_frac": 0.25}))  # fmt: skip
    event = JobEvent.from_proto(common_pb2.JobEvent.FromString(wire.SerializeToString()))
    assert event.env_error_reason == reason
    console = Console(width=200, record=True)
    console.print(format_event(event))
    assert f"env errors 2 (25%) first: {reason}" in console.export_text()
    view = TailView(job_id="j1", step_budget=3, kind="RL")
    view.update(event)  # no log line needed
    console = Console(width=200, record=True)
    console.print(view.render())
    assert f"env errors 2 (25%) — first: {reason}" in console.export_text()
    quiet = JobEvent.from_proto(common_pb2.JobEvent(seq=2, step=common_pb2.StepMetrics(step=2)))
    assert quiet.env_error_reason == "" and "first" not in format_event(quiet)


def test_fits_console_prints_env_errors_with_the_first_reason() -> None:
    from rich.console import Console

    from opentinker.console import event_printer
    from opentinker.jobs import JobEvent

    console = Console(width=200, record=True)
    show = event_printer(console=console)
    line = "env 'flaky': 2 of 8 episodes failed in step 1 (raise 2); first: step 1 failed: boom"
    show(JobEvent(1, 0.0, "step", step=1, metrics={"env_errors": 2.0, "env_error_frac": 0.25}))
    show(JobEvent(2, 0.0, "log", message=line))
    text = console.export_text()
    assert "env errors 2 (25%)" in text and line in text


def test_a_succeeded_inference_job_says_its_episodes_not_trainer_finished() -> None:
    from opentinker.common.v1 import common_pb2
    from opentinker.scheduler.v1 import scheduler_pb2
    from opentinker.services.scheduler.jobs.attempt_ends import finished_reason

    result = scheduler_pb2.JobResult(final_metrics={"episodes": 8.0, "env_errors": 1.0})
    infer = common_pb2.Job(spec=common_pb2.JobSpec(kind=common_pb2.JOB_KIND_INFERENCE))
    assert finished_reason(infer, result) == "8 episodes played, 1 failed in the environment"
    rl = common_pb2.Job(spec=common_pb2.JobSpec(kind=common_pb2.JOB_KIND_RL))
    assert finished_reason(rl, result) == "trainer finished"
