"""verifiers 0.4 envs play as agent programs (services/envhub/adapters/verifiers04*.py).

verifiers 0.4 lives in a virtual environment of its own (.ci/run makes .venv/verifiers04 with
the `verifiers04` extra's pin; $OPENTINKER_VERIFIERS04_PYTHON names another): 0.3 (the classic
adapter, the `adapters` extra, installed in .venv) is the same distribution name. The env here
is tests/rollout/vf04_envs/opentinker_letters04, a 0.4 env package as a user writes one: no package
on the index targets verifiers 0.4 yet (2026-11-29: `tasksets` 0.1.4 and `harnesses` 0.1.1 use the
pre-0.4 root API `vf.TasksetConfig`/`vf.UserConfig` that 0.4 moved under `verifiers.v1`;
`sophistry-bench-sprint` 0.1.6 is a classic SingleTurnEnv; `catapult-verifiers` pins <0.2).
Its rubric gives 0.3 + 0.4 * hit, so a reward of the rubric cannot be mistaken for another grade.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from agent_loop_helpers import Countdown, GameSession, RecordingEngine, model_turns
from test_agent_endpoint import play_with  # the in-process AgentLoop, as the endpoint's tests

from opentinker.errors import ConfigError
from opentinker.services.envhub.adapters.verifiers04 import (
    PYTHON_ENV_VAR,
    VerifiersVersionError,
    require_classic_verifiers,
    verifiers04_program,
)
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.types import FinishReason
from opentinker.spec_agent import AgentProgram

ROOT = Path(__file__).resolve().parents[2]
ENVS = Path(__file__).with_name("vf04_envs")
LETTERS = "ABCD"  # opentinker-letters04's default num_letters=4: task seed % 4 asks LETTERS[i]
FOLLOW_UP = "Once more, only the letter."


def _vf04_python() -> str | None:
    python = os.environ.get(PYTHON_ENV_VAR) or str(
        ROOT / ".venv" / "verifiers04" / "bin" / "python"
    )
    return python if Path(python).exists() else None


VF04_PYTHON = _vf04_python()
needs_vf04 = pytest.mark.skipif(
    VF04_PYTHON is None,
    reason=f"no verifiers 0.4 env: .ci/run makes .venv/verifiers04 (or set {PYTHON_ENV_VAR})",
)


def letters_program(timeout_s: float = 180) -> AgentProgram:
    assert VF04_PYTHON is not None
    return verifiers04_program(
        taskset="opentinker-letters04", python=VF04_PYTHON, paths=[ENVS], timeout_s=timeout_s
    )


def test_the_classic_check_refuses_04_and_names_what_to_use() -> None:
    require_classic_verifiers("0.3.1")  # the adapter's own pin passes
    require_classic_verifiers("0.3.2.dev4")
    with pytest.raises(VerifiersVersionError) as refused:
        require_classic_verifiers("0.4.0")
    message = str(refused.value)
    assert "verifiers 0.4.0 is installed" in message
    assert "opentinker[adapters]" in message and "verifiers04_program" in message
    assert isinstance(refused.value, ImportError)


def test_the_program_needs_a_taskset_and_a_python(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="needs a taskset id"):
        verifiers04_program(python="/x/python")
    monkeypatch.delenv(PYTHON_ENV_VAR, raising=False)
    with pytest.raises(ConfigError, match=PYTHON_ENV_VAR):
        verifiers04_program(taskset="gsm8k")
    program = verifiers04_program(
        env_config={"taskset": {"id": "gsm8k", "num_tasks": 3}}, python="/x/python", paths=["/e"]
    )
    assert program.command[0] == "/x/python" and program.command[1].endswith("verifiers04_agent.py")
    assert '"num_tasks": 3' in program.command[3] and program.command[4:] == ("--path", "/e")


@needs_vf04
def test_the_classic_adapter_refuses_the_real_04_at_import(tmp_path: Path) -> None:
    """verifiers 0.4 (the real package and its metadata) shadows 0.3: the adapter names it."""
    assert VF04_PYTHON is not None
    site = subprocess.run(
        [VF04_PYTHON, "-c", "import verifiers, os; print(os.path.dirname(verifiers.__path__[0]))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for entry in Path(site).iterdir():
        if entry.name == "verifiers" or entry.name.startswith("verifiers-"):
            (tmp_path / entry.name).symlink_to(entry)
    run = subprocess.run(
        [sys.executable, "-m", "opentinker.services.envhub.adapters.verifiers_adapter", "--help"],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": str(tmp_path)},
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "verifiers-adapter: verifiers 0.4.0 is installed" in run.stderr, run.stderr[-2000:]
    assert "verifiers04_program" in run.stderr


@needs_vf04
def test_the_agent_script_says_which_verifiers_a_python_has() -> None:
    """Run with the 0.3 Python by mistake: exit 2 naming the version found and the extra."""
    script = verifiers04_program(taskset="t", python=sys.executable).command[1:]
    run = subprocess.run([sys.executable, *script, "--seed", "0"], capture_output=True, text=True)
    assert run.returncode == 2
    assert "has verifiers 0.3." in run.stderr and "the verifiers04 extra" in run.stderr


@pytest.fixture
def engine(base_engine: TransformersEngine) -> RecordingEngine:
    return RecordingEngine(base_engine)


@pytest.mark.integration
@needs_vf04
def test_a_verifiers04_env_plays_through_the_endpoint(engine: RecordingEngine) -> None:
    """Two episodes (seeds 0, 1: tasks A, B): the harness's two calls are the engine's tokens,
    masked as the model's; the reward is the rubric's, for the letter of the seed's task."""
    sessions = [GameSession(Countdown(turns=1)) for _ in range(2)]
    trajectories = play_with(engine, letters_program(), sessions)
    produced = [c.token_ids for c in engine.completions]
    tokenizer = engine.tokenizer
    for seed, (t, session) in enumerate(zip(trajectories, sessions, strict=True)):
        assert t.finish_reason is FinishReason.ENV_DONE, t.finish_detail
        assert t.info["agent_calls"] == "2" and t.info["agent_rewrites"] == "0"
        turns = model_turns(t)
        assert len(turns) == 2 and all(turn in produced for turn in turns)
        completion = t.token_ids[t.prompt_length :]
        model_tokens = [tok for tok, m in zip(completion, t.loss_mask, strict=True) if m]
        assert model_tokens == turns[0] + turns[1]
        assert all((lp < 0) == bool(m) for lp, m in zip(t.logprobs, t.loss_mask, strict=True))
        between = [tok for tok, m in zip(completion, t.loss_mask, strict=True) if not m]
        assert FOLLOW_UP in tokenizer.decode(between)
        prompt = tokenizer.decode(t.token_ids[: t.prompt_length])
        assert f"Answer with the letter {LETTERS[seed]}." in prompt  # the seed's task
        last = tokenizer.decode(turns[1], skip_special_tokens=True)
        hit = last.strip().upper().startswith(LETTERS[seed])
        assert t.reward == pytest.approx(0.3 + 0.4 * hit)  # the rubric's, not the env's 0.25
        assert session.actions == []  # the program's reward: the env graded nothing
