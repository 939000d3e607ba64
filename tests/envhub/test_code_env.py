"""The ``code_math`` environment: multi-turn math with a sandboxed Python tool. Episodes that
answer right and wrong, the turn limit, escape attempts that come back as error observations,
and the python tool in the spec of the real env server."""

from __future__ import annotations

import json

import pytest

from opentinker.data import Dataset
from opentinker.env_server import serve
from opentinker.envhub.v1 import environment_pb2 as pb
from opentinker.envhub.v1 import environment_pb2_grpc
from opentinker.services.envhub.games.code_math_env import HINT, CodeMathGame, parse_reply

pytestmark = pytest.mark.integration

DATASET = Dataset.from_records(
    [
        {"prompt": "What is 37 * 91 - 1000?", "ground_truth": "2367", "split": "train"},
        {"prompt": "Compute 1/3 + 1/6.", "ground_truth": "\\frac{1}{2}", "split": "train"},
    ],
    source="<test rows>",
)


def game(**options: str) -> CodeMathGame:
    played = CodeMathGame(dataset=DATASET)
    played.reset(seed=0, index="0", **options)
    return played


def code(program: str) -> str:
    return f"Let me compute it.\n```python\n{program}\n```"


def test_code_then_a_right_answer_wins() -> None:
    played = game()
    first = played.step(code("print(37 * 91 - 1000)"))
    assert not first.done and first.reward == 0.0
    assert "```output\n2367\n```" in first.observation  # 37*91 = 3367; 3367-1000 = 2367
    assert "3 replies left" in first.observation
    final = played.step("The program printed it: \\boxed{2367}")
    assert (final.reward, final.done) == (1.0, True)
    assert final.info["ended_by"] == "answer" and final.info["correct"] == "true"
    assert (final.info["turns"], final.info["programs_run"]) == ("2", "1")


def test_a_fraction_answer_is_graded_by_value() -> None:
    played = CodeMathGame(dataset=DATASET)
    played.reset(seed=0, index="1")
    final = played.step("\\boxed{0.5}")  # 1/3 + 1/6 = 1/2
    assert (final.reward, final.done, final.info["correct"]) == (1.0, True, "true")


def test_a_wrong_answer_ends_with_zero() -> None:
    played = game()
    final = played.step("I think it is \\boxed{2368}")
    assert (final.reward, final.done) == (0.0, True)
    assert final.info["correct"] == "false" and final.info["ground_truth"] == "2367"
    assert "wrong" in final.observation


def test_the_turn_limit_ends_the_episode_with_zero() -> None:
    played = game(max_turns="2")
    hinted = played.step("Hmm, let me think about it.")
    assert not hinted.done and hinted.observation.startswith(HINT)
    ended = played.step(code("print(1)"))  # the last turn: no answer, so it ends unrun
    assert (ended.reward, ended.done) == (0.0, True)
    assert ended.info["ended_by"] == "turn_limit" and ended.info["programs_run"] == "0"
    assert "Turn limit reached (2 replies)" in ended.observation


def test_a_boxed_inside_code_is_not_a_final_answer() -> None:
    played = game()
    stepped = played.step(code('print("\\\\boxed{2367}")'))
    assert not stepped.done and "\\boxed{2367}" in stepped.observation


@pytest.mark.parametrize(
    ("program", "words"),
    [
        ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)", "socket"),
        ("print(open('/etc/passwd').read())", "opening /etc/passwd is not allowed"),
        ("import os\nwhile True:\n    os.fork()", "os.fork is not allowed"),
        ("import subprocess\nsubprocess.run(['ls', '/'])", "is not allowed"),
        ("while True:\n    pass", "ran longer than 1 s and was stopped"),
        ("while True:\n    print('x' * 1000)", "printed too much and was stopped"),
    ],
)
def test_escape_attempts_come_back_as_error_observations(program: str, words: str) -> None:
    played = game(timeout_s="1", max_turns="10")
    stepped = played.step(code(program))
    assert not stepped.done and stepped.reward == 0.0
    assert words in stepped.observation
    assert len(stepped.observation) < 3000  # the output is cut for the model
    assert "opentinker-sandbox-" not in stepped.observation  # its folder name is hidden
    # ...and the episode goes on as before.
    assert played.step("\\boxed{2367}").reward == 1.0


def test_tool_calls_run_and_bad_ones_are_explained() -> None:
    played = game()
    call = {"name": "python", "arguments": {"code": "print(2 ** 10)"}}
    ran = played.step(f"<tool_call>{json.dumps(call)}</tool_call>")
    assert "```output\n1024\n```" in ran.observation
    bad = played.step('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>')
    assert "could not read the tool call" in bad.observation and not bad.done


def test_programs_per_reply_are_bounded() -> None:
    played = game()
    reply = "\n".join(code(f"print({n})") for n in range(4))
    stepped = played.step(reply)
    for n in range(3):
        assert f"Program {n + 1} output:\n```output\n{n}\n```" in stepped.observation
    assert "Program 4 output: not run" in stepped.observation


def test_parse_reply_separates_code_from_prose() -> None:
    reply = parse_reply("Try:\n```python\nx = 1\nprint(x)\n```\nthen\n```py\nprint(2)")
    assert reply.programs == ["x = 1\nprint(x)\n", "print(2)"]  # an unclosed last block too
    assert "x = 1" not in reply.prose and not reply.answers


def test_bad_options_are_refused_together() -> None:
    with pytest.raises(ValueError) as info:
        game(max_turns="0", timeout_s="999", memory_mb="lots")
    for name in ("max_turns", "timeout_s", "memory_mb"):
        assert name in str(info.value)


def test_the_spec_of_the_served_env_lists_the_python_tool() -> None:
    handle = serve(lambda: CodeMathGame(dataset=DATASET), block=False)
    try:
        with handle.channel() as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            spec = stub.GetEnvironmentSpec(pb.GetEnvironmentSpecRequest(), timeout=5).spec
            reset = stub.Reset(pb.ResetRequest(episode_id="e", seed=3), timeout=5)
            stepped = stub.Step(
                pb.StepRequest(episode_id="e", action=code("print(6*7)")), timeout=10
            )
    finally:
        handle.stop(grace_s=0)
    assert (spec.name, spec.max_turns) == ("code_math", 4)
    [tool] = spec.tools
    schema = json.loads(tool.parameters_json_schema)
    assert tool.name == "python" and schema["required"] == ["code"]
    assert schema["properties"]["code"]["type"] == "string"
    assert "python" in reset.system_prompt and reset.observation in [
        row.prompt for row in DATASET.rows("train")
    ]
    assert "42" in stepped.observation and not stepped.done
