"""One verifiers rollout driven turn by turn from outside: the policy lives across the network.

A verifiers environment runs a whole rollout itself (``env.run_rollout``: set up the state,
ask a ``Client`` for the model's reply, call ``env_response``, check the stop conditions, score
with the rubric). ``VerifiersRollout`` runs exactly that, with a ``Client`` whose every
"model call" hands the prompt out (``next_event``) and waits for the reply text
(``reply``). So verifiers' own code decides every turn; we only carry messages.

The rollouts of a process share one event loop on a background thread; callers block on
``queue.Queue``. Knows nothing of gRPC.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from concurrent.futures import Future as ThreadFuture
from dataclasses import dataclass
from typing import Any

import verifiers as vf

from opentinker.services.envhub.adapters.verifiers04 import require_classic_verifiers

# verifiers 0.4 keeps only __version__ at its root: say so before its missing modules do.
require_classic_verifiers(getattr(vf, "__version__", "0"))

from verifiers.clients import Client  # noqa: E402 - after the version check above
from verifiers.types import Response, ResponseMessage, ToolCall  # noqa: E402

from opentinker.services.common.tool_calls import HERMES, parse_tool_calls  # noqa: E402

POLICY_MODEL = "opentinker-policy"  # the model name verifiers records; the policy is ours


@dataclass(frozen=True)
class PromptEvent:
    """verifiers asks the model: ``messages`` is the whole prompt of this turn."""

    messages: list[Any]


@dataclass(frozen=True)
class DoneEvent:
    """The rollout ended and was scored: verifiers' ``RolloutOutput`` dict."""

    output: dict[str, Any]


@dataclass(frozen=True)
class FailedEvent:
    """The rollout raised (outside verifiers' own error handling)."""

    error: BaseException


Event = PromptEvent | DoneEvent | FailedEvent


class _Loop:
    """The background event loop the rollouts of this process share (started on first use)."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(
                    target=cls._loop.run_forever, name="verifiers-loop", daemon=True
                ).start()
            return cls._loop


class _BridgeClient(Client):
    """A verifiers ``Client`` whose model is whoever calls ``VerifiersRollout.reply``."""

    def __init__(self, rollout: VerifiersRollout) -> None:
        super().__init__(object())  # no provider client behind it
        self._rollout = rollout

    def setup_client(self, config):  # never called: built from an object, not a config
        raise NotImplementedError

    async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs) -> Response:
        text = await self._rollout._ask(list(prompt))
        tool_names = [tool.name for tool in tools or ()]
        calls = parse_tool_calls(text, tool_names, HERMES).calls if tool_names else ()
        tool_calls = [
            ToolCall(
                id=f"call_{uuid.uuid4().hex[:12]}", name=c.name, arguments=json.dumps(c.arguments)
            )
            for c in calls
        ]
        message = ResponseMessage(
            content=text,
            tool_calls=tool_calls or None,
            finish_reason="tool_calls" if tool_calls else "stop",
            is_truncated=False,
        )
        return Response(id=uuid.uuid4().hex, created=int(time.time()), model=model, message=message)

    # The provider hooks of the abstract Client: unused, get_response is overridden whole.
    async def to_native_tool(self, tool):
        return tool

    async def to_native_prompt(self, messages):
        return messages, {}

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        raise NotImplementedError

    async def raise_from_native_response(self, response) -> None:
        return None

    async def from_native_response(self, response):
        return response

    async def close(self) -> None:
        return None


class VerifiersRollout:
    """One rollout of ``env`` on dataset row ``row``; step it with ``next_event``/``reply``."""

    def __init__(self, env: vf.Environment, row: dict[str, Any]) -> None:
        self._events: queue.Queue[Event] = queue.Queue()
        self._loop = _Loop.get()
        self._pending: asyncio.Future[str] | None = None
        self._task: ThreadFuture[None] = asyncio.run_coroutine_threadsafe(
            self._run(env, row), self._loop
        )

    def next_event(self, timeout_s: float) -> Event:
        """The next thing verifiers did: ask the model, finish, or fail (``queue.Empty`` when
        nothing happened within ``timeout_s``)."""
        return self._events.get(timeout=timeout_s)

    def reply(self, text: str) -> None:
        """The model's answer to the last ``PromptEvent``."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("reply() without a pending prompt")
        self._loop.call_soon_threadsafe(_resolve, pending, text)

    def cancel(self) -> None:
        """Stop the rollout (e.g. the episode was closed mid-way)."""
        self._task.cancel()

    async def _ask(self, messages: list[Any]) -> str:
        pending: asyncio.Future[str] = self._loop.create_future()
        self._pending = pending
        self._events.put(PromptEvent(messages))
        return await pending

    async def _run(self, env: vf.Environment, row: dict[str, Any]) -> None:
        try:
            output = await env.run_rollout(row, _BridgeClient(self), POLICY_MODEL, {})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # verifiers' own errors end up in output["error"]
            self._events.put(FailedEvent(exc))
            return
        self._events.put(DoneEvent(dict(output)))


def _resolve(pending: asyncio.Future[str], text: str) -> None:
    if not pending.done():
        pending.set_result(text)
