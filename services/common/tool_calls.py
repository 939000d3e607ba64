"""Tool calls parsed from a model turn, in the format its chat template teaches.

The env always receives the turn's raw text (``StepRequest.action``); for an env that declares
tools, the calls found in it also travel parsed (``StepRequest.tool_calls``), and a call that
cannot be parsed travels as an error line (``StepRequest.tool_call_errors``) so the env can tell
the model what was wrong. Nothing here ends an episode.

Formats: ``hermes`` (Qwen2.5, Hermes, and every template that shows the model
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``). A template that renders no tool
format gets no parsing (``style_of`` returns None): the env parses the raw text itself.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

HERMES = "hermes"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCalls:
    """The calls of one model turn, in order, and why any other call could not be parsed
    (one line each, naming the call's position: ``call 2: ...``)."""

    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()


def style_of(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches the model, or None (none we know)."""
    if chat_template and "<tool_call>" in chat_template:
        return HERMES
    return None


def parse_tool_calls(text: str, tool_names: Collection[str], style: str | None) -> ToolCalls:
    """The tool calls in a model turn's ``text``; ``tool_names`` are the env's tools."""
    if style != HERMES:
        return ToolCalls()
    calls, errors = [], []
    for number, match in enumerate(_HERMES_BLOCK.finditer(text), start=1):
        body, closed = match.group(1).strip(), bool(match.group(2))
        call, problem = _hermes_call(body, tool_names)
        if not closed:
            problem = "no closing </tool_call>" + (f"; {problem}" if problem else "")
        if problem or call is None:
            errors.append(f"call {number}: {problem}: {body[:200]!r}")
        else:
            calls.append(call)
    return ToolCalls(tuple(calls), tuple(errors))


def _hermes_call(body: str, tool_names: Collection[str]) -> tuple[ToolCall | None, str]:
    """A ``{"name": ..., "arguments": {...}}`` body as a call, or why it is not one."""
    data, problem = _json_of(body)
    if problem:
        return None, f"not JSON ({problem})"
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None, 'not an object with a "name" string'
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        arguments, problem = _json_of(arguments)
        if problem:
            return None, f'"arguments" is a string that is not JSON ({problem})'
    if not isinstance(arguments, dict):
        return None, '"arguments" is not a JSON object'
    if data["name"] not in tool_names:
        return None, f"unknown tool {data['name']!r} (tools: {sorted(tool_names)})"
    return ToolCall(data["name"], arguments), ""


def _json_of(text: str) -> tuple[Any, str]:
    """The JSON value of ``text``, or why it is none ('' when it is one). Python's json also
    reads NaN and Infinity, which are not JSON (an env in another language could not read the
    arguments_json they travel as), reads a number past a float's range (1e400) as inf, which
    would travel as Infinity, and raises RecursionError on deep nesting."""
    try:
        return json.loads(text, parse_constant=_not_json, parse_float=_finite), ""
    except json.JSONDecodeError as err:
        return None, f"{err.msg} at character {err.pos}"
    except ValueError as err:  # _not_json
        return None, str(err)
    except RecursionError:
        return None, "nested too deeply"


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not a JSON number")


def _finite(number: str) -> float:
    value = float(number)
    if not math.isfinite(value):
        raise ValueError(f"{number} is beyond a float's range")
    return value
