"""``code_math``: multi-turn math with a Python interpreter (tool calling).

Each episode is one row of the math dataset (``DatasetGame``: the seed picks it; reset options
``split`` and ``index``). Every reply of the model is one turn:

- a final answer in ``\\boxed{}`` outside any code ends the episode: reward 1.0 when it equals
  the ground truth as a value (``math_grading.is_equivalent``), else 0.0;
- otherwise its code runs: each fenced ```` ```python ```` block, or each ``python`` tool call
  (``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>``), runs in a fresh
  ``sandbox.run_python`` process, and what it printed (stdout and stderr, truncated) comes back
  as the next observation; a refused or crashing program is an error message there, never a
  failed episode;
- a reply with neither gets a short hint;
- the turn that reaches ``max_turns`` without an answer ends the episode with reward 0.0.

Reset options (all strings): ``max_turns`` (1-20, default 4), ``timeout_s`` (wall-clock
seconds per code block, up to 30), ``memory_mb`` (64-4096), ``output_chars`` (characters of
output shown per block, 100-8000). The blocks of one turn share ``turn_time_budget_s`` so that
a step answers within EnvHub's call deadline; blocks past the budget are skipped and say so.
The last step's info says how the episode ended (``ended_by``: ``answer`` or ``turn_limit``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import ClassVar

from opentinker.data import TRAIN, Dataset
from opentinker.dataset_game import DatasetGame
from opentinker.game import StepResult, Tool
from opentinker.services.envhub.games.math_dataset import default_math_dataset
from opentinker.services.envhub.games.math_grading import extracted_answer, is_equivalent
from opentinker.services.envhub.games.sandbox import SandboxLimits, SandboxResult, run_python

PYTHON_TOOL = Tool(
    name="python",
    description=(
        "Run a Python 3 program in a sandbox (no network, no files outside its folder, limited "
        "time and memory) and return what it prints. Each call starts a fresh interpreter; "
        "print every value you need."
    ),
    parameters={
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python program to run."}},
        "required": ["code"],
    },
)

_CODE_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_SANDBOX_FOLDER = re.compile(r"/\S*?opentinker-sandbox-[^/\s]+/")
_OPTION_RANGES = {
    "max_turns": (1, 20),
    "timeout_s": (0.1, 30.0),
    "memory_mb": (64, 4096),
    "output_chars": (100, 8000),
}
HINT = (
    "No code and no final answer found. Write Python in a ```python block to compute, or give "
    "your final answer in \\boxed{}."
)


@dataclasses.dataclass(frozen=True)
class ParsedReply:
    """A model reply split into its prose (code removed), its programs, and bad tool calls."""

    prose: str
    programs: list[str]
    call_errors: list[str]

    @property
    def answers(self) -> bool:
        return "\\boxed" in self.prose


def parse_reply(text: str) -> ParsedReply:
    """Find the programs (```python blocks and ``python`` tool calls) and the prose around."""
    programs: list[str] = []
    call_errors: list[str] = []

    def take_block(match: re.Match[str]) -> str:
        programs.append(match.group(1))
        return "\n"

    def take_call(match: re.Match[str]) -> str:
        try:
            call = json.loads(match.group(1))
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if call.get("name") != PYTHON_TOOL.name or not isinstance(arguments.get("code"), str):
                raise ValueError('expected {"name": "python", "arguments": {"code": "..."}}')
            programs.append(arguments["code"])
        except (ValueError, AttributeError) as exc:
            call_errors.append(f"could not read the tool call: {exc}")
        return "\n"

    prose = _TOOL_CALL.sub(take_call, _CODE_BLOCK.sub(take_block, text))
    return ParsedReply(prose=prose, programs=programs, call_errors=call_errors)


def _options(**given: str) -> dict[str, float]:
    values, problems = {}, []
    for name, text in given.items():
        low, high = _OPTION_RANGES[name]
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        whole = isinstance(low, int)
        if not low <= value <= high or (whole and not value.is_integer()):
            kind = "an integer" if whole else "a number"
            problems.append(f"{name} must be {kind} in [{low}, {high}], got {text!r}")
        values[name] = value
    if problems:
        raise ValueError("env option " + "; ".join(problems))
    return values


class CodeMathGame(DatasetGame):
    """Math problems solved with a sandboxed Python tool over several turns.

    Class attributes (the defaults that reset options override): ``max_turns``,
    ``sandbox_limits`` (per block), ``output_chars`` (shown per block), ``turn_time_budget_s``
    (wall-clock seconds for all blocks of one turn), ``max_programs_per_turn``.
    """

    name = "code_math"
    description = (
        "Multi-turn: solve a math problem with a sandboxed Python tool; reward 1 for the right "
        "boxed answer."
    )
    max_turns = 4
    tools = (PYTHON_TOOL,)
    sandbox_limits: ClassVar[SandboxLimits] = SandboxLimits(
        wall_time_s=5.0, cpu_time_s=5, memory_bytes=1 << 30, output_bytes=16 * 1024
    )
    output_chars: ClassVar[int] = 2000
    turn_time_budget_s: ClassVar[float] = 8.0
    max_programs_per_turn: ClassVar[int] = 3

    def __init__(self, dataset: Dataset | str | Path | None = None) -> None:
        super().__init__(dataset if dataset is not None else default_math_dataset())
        self.turn_limit = self.max_turns
        self.limits = self.sandbox_limits
        self.shown_chars = self.output_chars
        self.turns = 0
        self.programs_run = 0

    def get_system_prompt(self) -> str:
        return (
            "Solve the math problem. You may run Python: write a program in a ```python code "
            "block (or call the python tool) and you will see what it prints. Each program runs "
            "on its own in a fresh interpreter, so print every value you need. When you know "
            "the answer, reply with only the final answer in \\boxed{}, e.g. "
            f"\\boxed{{\\frac{{3}}{{4}}}}. You have at most {self.turn_limit} replies."
        )

    def reset(
        self,
        *,
        seed: int = 0,
        split: str = TRAIN,
        index: str = "",
        max_turns: str = "",
        timeout_s: str = "",
        memory_mb: str = "",
        output_chars: str = "",
    ) -> str:
        given = {
            "max_turns": max_turns,
            "timeout_s": timeout_s,
            "memory_mb": memory_mb,
            "output_chars": output_chars,
        }
        values = _options(**{name: text for name, text in given.items() if text})
        self.turn_limit = int(values.get("max_turns", self.max_turns))
        self.shown_chars = int(values.get("output_chars", self.output_chars))
        self.limits = self.sandbox_limits
        if "timeout_s" in values:
            self.limits = dataclasses.replace(self.limits, wall_time_s=values["timeout_s"])
        if "memory_mb" in values:
            self.limits = dataclasses.replace(
                self.limits, memory_bytes=int(values["memory_mb"]) * 2**20
            )
        self.turns = 0
        self.programs_run = 0
        return super().reset(seed=seed, split=split, index=index)

    def step(self, action: str) -> StepResult:
        self.turns += 1
        reply = parse_reply(action)
        if reply.answers:
            return self._graded(reply.prose)
        if self.turns >= self.turn_limit:
            return self._ended(
                f"Turn limit reached ({self.turn_limit} replies) without a final answer in "
                "\\boxed{}."
            )
        if reply.programs:
            observation = self._run_all(reply.programs)
        elif reply.call_errors:
            observation = "\n".join(reply.call_errors) + "\n" + HINT
        else:
            observation = HINT
        left = self.turn_limit - self.turns
        observation += f"\n({left} repl{'y' if left == 1 else 'ies'} left.)"
        return StepResult(observation=observation, reward=0.0, done=False, info=self._info())

    def _run_all(self, programs: list[str]) -> str:
        deadline = time.monotonic() + self.turn_time_budget_s
        parts = []
        for number, program in enumerate(programs, start=1):
            label = f"Program {number} output" if len(programs) > 1 else "Output"
            remaining = deadline - time.monotonic()
            if number > self.max_programs_per_turn or remaining < 0.5:
                parts.append(
                    f"{label}: not run (at most {self.max_programs_per_turn} programs and "
                    f"{self.turn_time_budget_s:g} s per reply)."
                )
                continue
            limits = dataclasses.replace(
                self.limits, wall_time_s=min(self.limits.wall_time_s, remaining)
            )
            result = run_python(program, limits=limits)
            self.programs_run += 1
            parts.append(f"{label}:\n```output\n{self._shown(result, limits)}\n```")
        return "\n".join(parts)

    def _shown(self, result: SandboxResult, limits: SandboxLimits) -> str:
        text = _SANDBOX_FOLDER.sub("", result.output).rstrip("\n")
        if len(text) > self.shown_chars:
            cut = len(text) - self.shown_chars
            text = f"{text[: self.shown_chars]}\n[... {cut} more characters not shown]"
        notes = []
        if result.timed_out:
            notes.append(
                f"Error: the program ran longer than {limits.wall_time_s:g} s and was stopped."
            )
        elif result.output_truncated:
            notes.append("Error: the program printed too much and was stopped.")
        elif result.exit_code is not None and result.exit_code < 0:
            notes.append(f"Error: the program was killed (signal {-result.exit_code}).")
        elif not text:
            notes.append("(the program printed nothing; use print() to see values)")
        return "\n".join([text, *notes] if text else notes)

    def _graded(self, prose: str) -> StepResult:
        correct = is_equivalent(prose, self.row.ground_truth)
        verdict = "correct" if correct else "wrong"
        return StepResult(
            observation=f"Final answer received: {verdict}.",
            reward=1.0 if correct else 0.0,
            done=True,
            info={
                **self._info(),
                "ground_truth": self.row.ground_truth,
                "ended_by": "answer",
                "answer": extracted_answer(prose),
                "correct": str(correct).lower(),
            },
        )

    def _ended(self, message: str) -> StepResult:
        info = {
            **self._info(),
            "ground_truth": self.row.ground_truth,
            "ended_by": "turn_limit",
            "answer": "",
            "correct": "false",
        }
        return StepResult(observation=message, reward=0.0, done=True, info=info)

    def _info(self) -> dict[str, str]:
        return {"turns": str(self.turns), "programs_run": str(self.programs_run)}
