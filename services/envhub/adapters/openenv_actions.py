"""The model's text -> an OpenEnv action (JSON), and an OpenEnv observation -> text.

Which action format an OpenEnv server takes is read from its action JSON schema (``/schema``):
- MCP (the schema is OpenEnv's ``CallToolAction``: ``tool_name`` + ``arguments``): the model
  calls the server's MCP tools with ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` blocks (the Hermes/Qwen format), each sent as ``{"type": "call_tool",
  "tool_name": ..., "arguments": ...}``.
- one required string field (e.g. the echo env's ``message``): the whole text fills it.
- otherwise: the text must be one JSON object (bare or in a ```json fence) holding every
  required field of the schema.
Text that does not fit is not an environment error but the model's mistake: it is told what
was wrong (``ActionError``), and the episode goes on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from opentinker.game import Tool
from opentinker.services.common.tool_calls import HERMES, parse_tool_calls

_JSON_FENCE = re.compile(r"```(?:json)?\s*(\{.*\})\s*```", re.DOTALL)
_HIDDEN_OBSERVATION_FIELDS = frozenset({"reward", "done", "metadata"})


class ActionError(ValueError):
    """The model's text is no valid action; the message says why, for the model to read."""


@dataclass(frozen=True)
class ActionFormat:
    """How text becomes actions for one OpenEnv server (built from its action schema).

    mcp: the server takes MCP tool calls; tools: its MCP tools (then), else none.
    text_field: the one required string field the text fills ('' = none).
    schema: the action JSON schema (for the system prompt and the required-field check).
    """

    schema: dict[str, Any]
    mcp: bool = False
    text_field: str = ""
    tools: tuple[Tool, ...] = ()

    @classmethod
    def of(cls, schema: dict[str, Any]) -> ActionFormat:
        properties = schema.get("properties") or {}
        if {"tool_name", "arguments"} <= set(properties):
            return cls(schema=schema, mcp=True)
        required = [name for name in schema.get("required") or () if name != "type"]
        if len(required) == 1 and (properties.get(required[0]) or {}).get("type") == "string":
            return cls(schema=schema, text_field=required[0])
        return cls(schema=schema)

    def with_tools(self, tools: tuple[Tool, ...]) -> ActionFormat:
        return ActionFormat(schema=self.schema, mcp=self.mcp, tools=tools)

    def actions_of(self, text: str) -> list[dict[str, Any]]:
        """The actions to send for one model turn (MCP: one per tool call, maybe none)."""
        if self.mcp:
            parsed = parse_tool_calls(text, [tool.name for tool in self.tools], HERMES)
            if parsed.errors:
                raise ActionError("; ".join(parsed.errors))
            return [
                {"type": "call_tool", "tool_name": call.name, "arguments": call.arguments}
                for call in parsed.calls
            ]
        if self.text_field:
            return [{self.text_field: text}]
        return [self._json_action(text)]

    def instructions(self) -> str:
        """What the system prompt tells the model about replying."""
        if self.mcp:
            return (
                'Call the tools with <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
                " blocks; a reply without a tool call ends the episode."
            )
        if self.text_field:
            return "Reply with plain text; it is your action."
        return (
            "Reply with one JSON object for your action, matching this JSON schema: "
            + json.dumps(self.schema, sort_keys=True)
        )

    def _json_action(self, text: str) -> dict[str, Any]:
        fenced = _JSON_FENCE.search(text)
        body = fenced.group(1) if fenced else text.strip()
        try:
            action = json.loads(body)
        except ValueError as exc:
            raise ActionError(f"your reply is not one JSON object ({exc})") from exc
        if not isinstance(action, dict):
            raise ActionError("your reply must be a JSON object, not " + type(action).__name__)
        missing = [name for name in self.schema.get("required") or () if name not in action]
        if missing:
            raise ActionError(f"your action lacks the required field(s) {missing}")
        return action


def tools_of(list_tools_observation: dict[str, Any]) -> tuple[Tool, ...]:
    """OpenEnv's ``ListToolsObservation`` (``{"tools": [{name, description, input_schema}]}``)
    as our tools; an entry without a name is skipped."""
    tools = list_tools_observation.get("tools")
    if not isinstance(tools, list):
        raise ValueError("the list_tools observation has no 'tools' list")
    return tuple(
        Tool(
            name=entry["name"],
            description=str(entry.get("description") or ""),
            parameters=entry.get("input_schema") or {"type": "object"},
        )
        for entry in tools
        if isinstance(entry, dict) and isinstance(entry.get("name"), str)
    )


def observation_text(observation: dict[str, Any]) -> str:
    """An observation as the model's next message.

    An MCP call's ``result`` is shown in a ``<tool_response>`` block (its error as ``error:
    ...``); an observation with one text field shows that text, then each other set field as a
    ``name: value`` line; anything else is compact JSON of its fields.
    """
    if "tool_name" in observation and ("result" in observation or "error" in observation):
        return _tool_result_text(observation)
    visible = {
        k: v
        for k, v in observation.items()
        if k not in _HIDDEN_OBSERVATION_FIELDS and v is not None
    }
    texts = [k for k, v in visible.items() if isinstance(v, str)]
    if len(texts) != 1:
        return json.dumps(visible, sort_keys=True, separators=(",", ":"), default=str)
    lines = [visible[texts[0]]]
    lines += [f"{k}: {json.dumps(v, default=str)}" for k, v in visible.items() if k != texts[0]]
    return "\n".join(lines)


def _tool_result_text(observation: dict[str, Any]) -> str:
    error = observation.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else error
        return f"<tool_response>\nerror: {message}\n</tool_response>"
    result = observation.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):  # CallToolResult
        result = "\n".join(
            str(part.get("text", "")) for part in result["content"] if isinstance(part, dict)
        )
    text = result if isinstance(result, str) else json.dumps(result, default=str)
    return f"<tool_response>\n{text}\n</tool_response>"
