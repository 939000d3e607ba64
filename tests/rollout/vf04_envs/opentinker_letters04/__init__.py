"""A verifiers 0.4 environment package as a user would write one (``vf-init`` layout in one
file): a ``Taskset`` of letter tasks scored by a ``@vf.reward`` and a two-turn chat harness.

The harness runs its loop in-process with the ``openai`` client (verifiers allows that as long
as every model call goes through the interception ``endpoint`` and ``secret``): the shipped
``null``/``bash`` harnesses install their program with ``uv`` at run time, which a test may not.
The reward is ``0.3 + 0.4 * hit`` so a test can tell the rubric's reward from any other grade.
Imported only by the Python of the verifiers 0.4 virtual environment (taskset id
``opentinker-letters04``)."""

from __future__ import annotations

import string

import openai
import verifiers.v1 as vf

SYSTEM_PROMPT = "Answer with one capital letter."
FOLLOW_UP = "Once more, only the letter."


class LettersData(vf.TaskData):
    """One task: the letter the model should answer with."""

    answer: str = "A"


class LettersTask(vf.Task[LettersData]):
    @vf.reward(weight=1.0)
    async def letter(self, trace: vf.Trace) -> float:
        hit = trace.last_reply.strip().upper().startswith(self.data.answer)
        return 0.3 + 0.4 * hit


class LettersConfig(vf.TasksetConfig):
    num_letters: int = 4


class LettersTaskset(vf.Taskset[LettersTask, LettersConfig]):
    def load(self) -> list[LettersTask]:
        return [
            LettersTask(
                LettersData(
                    prompt=f"Answer with the letter {letter}.",
                    system_prompt=SYSTEM_PROMPT,
                    answer=letter,
                ),
                self.config.task,
            )
            for letter in string.ascii_uppercase[: self.config.num_letters]
        ]


class LettersHarnessConfig(vf.HarnessConfig):
    pass


class LettersHarness(vf.Harness[LettersHarnessConfig]):
    """Ask, then ask once more after the model's reply: two model calls per episode."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        system, prompt = self.resolve_text_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            for turn in range(2):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                if turn == 0:
                    messages.append({"role": "user", "content": FOLLOW_UP})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout=messages[-1]["content"] or "", stderr="")


__all__ = ["LettersHarness", "LettersTaskset"]
