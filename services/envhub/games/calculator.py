"""The ``calculator`` tool of the multi-turn envs (``geometry_tools``, ``arithmetic_tools``):
its schema, a safe evaluator (``ast``: numbers, + - * / ** with a bounded exponent, unary
minus; never ``eval``), the replies to a turn's calls, and the final ``\\boxed{}`` answer read
outside the calls (a boxed number inside a call's arguments is not an answer).
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from opentinker.game import Tool
from opentinker.services.common.tool_calls import HERMES, parse_tool_calls

CALCULATOR_TOOL = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression (+ - * / ** and parentheses) and return it.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2"}},
        "required": ["expression"],
    },
)
_BOXED = re.compile(r"\\boxed\{\s*(-?\d+(?:\.\d+)?)\s*\}")
_TOOL_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|\Z)", re.DOTALL)
_OPERATORS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def calculate(expression: str) -> float:
    """An arithmetic expression's value; ValueError names what is not allowed."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 16:
                raise ValueError("exponents above 16 are not allowed")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:80]}")

    try:
        return value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as err:
        raise ValueError(str(err)) from err


def boxed_answer(reply: str) -> float | None:
    """The last ``\\boxed{number}`` outside tool calls, or None."""
    found = _BOXED.findall(_TOOL_BLOCK.sub("", reply))
    return float(found[-1]) if found else None


def calculator_replies(action: str) -> str:
    """The next observation for a reply with calculator calls: each call's result or error."""
    parsed = parse_tool_calls(action, {CALCULATOR_TOOL.name}, HERMES)
    lines = list(parsed.errors)
    for call in parsed.calls:
        expression = str(call.arguments.get("expression", ""))
        try:
            lines.append(f"{expression} = {calculate(expression):g}")
        except ValueError as err:
            lines.append(f"{expression!r}: error: {err}")
    lines.append("Call the calculator or give your final answer in \\boxed{}.")
    return "\n".join(lines)
