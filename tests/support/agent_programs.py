"""Agent programs of the tests, written against the installed ``openai`` client as a user
would: a tool-calling loop with a calculator. Importable (``agent_programs:calculator_agent``)
and runnable as a command (``python agent_programs.py``: OPENAI_BASE_URL, OPENAI_API_KEY,
OPENTINKER_TASK in its environment; prints the reward, null here, as its last line)."""

from __future__ import annotations

import ast
import json
import operator
import os

import openai

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as 2+3*4.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """+, - and * of integers; anything else is an error string (the model sees it)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"cannot evaluate {ast.dump(node)[:40]}")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError) as err:
        return f"error: {err}"


def calculator_agent(*, base_url: str, api_key: str, task: str, seed: int) -> float | None:
    """Ask; run every calculator call the model makes and send the results back; when the
    model calls no tool, give it the calculator's result of 2+3 once as a tool would, then
    take its next reply as the answer (None: the env grades it)."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages: list[dict] = [{"role": "user", "content": task}]
    hinted = False
    for _ in range(4):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR], seed=seed
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments).get("expression", "")
                result = calculate(str(expression))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        elif not hinted:
            messages.append({"role": "user", "content": f"calculator(2+3) = {calculate('2+3')}"})
            hinted = True
        else:
            return None
    return None


def streaming_agent(*, base_url: str, api_key: str, task: str, seed: int) -> float:
    """One streamed call; its reward is the number of characters it received, capped at 1."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task}], stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    return min(1.0, len(text) / 10)


if __name__ == "__main__":
    calculator_agent(
        base_url=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ["OPENAI_API_KEY"],
        task=os.environ["OPENTINKER_TASK"],
        seed=int(os.environ.get("OPENTINKER_SEED", "0")),
    )
    print(json.dumps(None))
