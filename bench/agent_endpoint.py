"""Episodes/s of a multi-turn task played through the rollout's per-episode OpenAI-compatible
endpoint (an agent program with the openai client) vs the same task through Reset/Step (the
agent loop), one run, same engine, same env.

The task: ``--turns`` model turns of at most ``--new-tokens`` tokens each; after each turn
but the last, a user message ("Turn k: go on.") comes back — from the env's Step on the
Reset/Step path, from the agent program itself on the endpoint path — and the env grades the
last answer. The env runs in-process on both paths, so the figure isolates the endpoint's
hop: HTTP, the openai client, the program's thread and the prefix matching. Each round plays
one batch on each path, back to back, and gives a ratio of the two rates (a busy machine
slows both sides of a round alike); the last lines are the median ratio of the rounds and
its spread (target >= 0.8). "engine busy" is the share of a batch's time spent generating:
what is left is the path's own overhead (the env, or HTTP and the programs).

    .venv/bin/python bench/agent_endpoint.py [--episodes 16] [--turns 4] [--rounds 5]
        [--agent turns_agent | turns_agent_async]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import openai
from arguments import positive_int  # bench/ is sys.path[0]

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.rollout.agent.agent_loop import AgentLoop
from opentinker.services.rollout.agent.loop_config import EpisodeRequest, LoopConfig
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.types import FinishReason, ResetResult, StepOutcome
from opentinker.spec import ModelSpec, SamplingParams
from opentinker.spec_agent import AgentProgram

TURNS = 4  # set from --turns before any episode plays
CLIENT_PER_EPISODE = False  # set from --client-per-episode
PATHS = ("reset/step", "endpoint")


def follow_up(turn: int) -> str:
    return f"Turn {turn}: go on."


class TurnsEnv:
    """An in-process env session: ``TURNS`` steps, a follow-up message after each but the
    last; reward 1 for a non-empty answer."""

    def __init__(self, *, grade_only: bool) -> None:
        self.grade_only, self.steps = grade_only, 0

    async def reset(self, seed: int, options: Mapping[str, str]) -> ResetResult:
        return ResetResult("", f"Task {seed}: say something, {TURNS} times.")

    async def step(self, action: str, tool_calls: object = None) -> StepOutcome:
        self.steps += 1
        done = self.grade_only or self.steps >= TURNS
        return StepOutcome(follow_up(self.steps), float(bool(action.strip())), done)

    async def close(self) -> None:
        return None


# One HTTP client for every episode's openai client (unless --client-per-episode): a new
# openai client builds its own httpx client and SSL context (loading the CA bundle), ~0.16 s
# of CPU each, 2.6 s of a 16-episode batch's 5.9 s of event-loop work in a profile of
# turns_agent_async: the program's cost, not the endpoint's.
SHARED_HTTP: dict[str, Any] = {}


def _http(kind: str) -> Any:
    if CLIENT_PER_EPISODE:
        return None
    if kind not in SHARED_HTTP:
        make = openai.DefaultHttpxClient if kind == "sync" else openai.DefaultAsyncHttpxClient
        SHARED_HTTP[kind] = make()
    return SHARED_HTTP[kind]


def turns_agent(*, base_url: str, api_key: str, task: str, seed: int) -> None:
    """The same task as an agent program: TURNS calls, the follow-up between them."""
    client = openai.OpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, http_client=_http("sync")
    )
    messages: list[Any] = [{"role": "user", "content": task}]
    for turn in range(1, TURNS + 1):
        reply = client.chat.completions.create(model="policy", messages=messages)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        if turn < TURNS:
            messages.append({"role": "user", "content": follow_up(turn)})


async def turns_agent_async(*, base_url: str, api_key: str, task: str, seed: int) -> None:
    """The same program with the async client: awaited in the rollout's loop, no thread."""
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, http_client=_http("async")
    )
    messages: list[Any] = [{"role": "user", "content": task}]
    for turn in range(1, TURNS + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        if turn < TURNS:
            messages.append({"role": "user", "content": follow_up(turn)})


class CountingEngine:
    """The engine, counting its generate calls (how well each path batches)."""

    def __init__(self, engine: TransformersEngine) -> None:
        self.inner, self.name, self.tokenizer = engine, engine.name, engine.tokenizer
        self.policy_version = engine.policy_version
        self.calls = 0

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.generate(*args, **kwargs)


def path_loop(engine: CountingEngine, args: argparse.Namespace, endpoint: bool) -> AgentLoop:
    """One path's loop, kept for every batch as a job's rollout keeps its own (the endpoint's
    program threads are started once, the server per batch)."""
    config = LoopConfig(
        sampling=SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens),
        max_turns=TURNS,
        max_episode_tokens=4096,
        agent=AgentProgram(callable=f"agent_endpoint:{args.agent}") if endpoint else None,
    )
    return AgentLoop(engine, config)  # type: ignore[arg-type]  # the engine, counted


async def play(loop: AgentLoop, args: argparse.Namespace) -> tuple[float, float, float]:
    """Episodes/s of one batch of ``--episodes`` episodes on one path, the model tokens per
    episode (sampling differs between the paths: the token counts tell how much) and the
    share of the batch's time the engine was generating."""
    endpoint = loop.agent_programs is not None
    requests = [
        EpisodeRequest(f"ep-{n}", n, n, TurnsEnv(grade_only=endpoint)) for n in range(args.episodes)
    ]
    started = time.perf_counter()
    trajectories, stats = await loop.run(requests, seed=1)
    elapsed = time.perf_counter() - started
    bad = [t.finish_detail for t in trajectories if t.finish_reason is FinishReason.ENV_ERROR]
    turns = {t.num_turns for t in trajectories}
    if bad or turns != {TURNS}:
        raise SystemExit(f"the episodes did not play {TURNS} turns: {turns}, errors {bad[:2]}")
    return (
        len(trajectories) / elapsed,
        stats.generated_tokens / len(trajectories),
        stats.generate_seconds / elapsed,
    )


async def run_rounds(
    loops: dict[str, AgentLoop], args: argparse.Namespace, engine: CountingEngine
) -> dict[str, dict[str, list[float]]]:
    """A warm-up batch per path, then ``--rounds`` rounds of one batch per path (the order
    alternating); per path and round: rate, tokens per episode, engine share, engine calls."""
    for loop in loops.values():  # imports, the server's first start, caches
        await play(loop, args)
    figures: dict[str, dict[str, list[float]]] = {
        name: {"rate": [], "tokens": [], "busy": [], "calls": []} for name in loops
    }
    names = list(loops)
    for n in range(args.rounds):
        for name in names if n % 2 == 0 else names[::-1]:  # neither always goes first
            before = engine.calls
            rate, per_episode, share = await play(loops[name], args)
            for key, value in (("rate", rate), ("tokens", per_episode), ("busy", share)):
                figures[name][key].append(value)
            figures[name]["calls"].append(engine.calls - before)
        ratio = figures["endpoint"]["rate"][-1] / figures["reset/step"]["rate"][-1]
        print(f"round {n + 1}: endpoint / reset-step {ratio:.2f}x", flush=True)
    for loop in loops.values():
        if loop.agent_programs is not None:
            await loop.agent_programs.close()
    return figures


def main() -> None:
    global TURNS, CLIENT_PER_EPISODE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=positive_int, default=16)
    parser.add_argument("--turns", type=positive_int, default=4)
    parser.add_argument("--new-tokens", type=positive_int, default=16)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument(
        "--agent",
        choices=("turns_agent", "turns_agent_async"),
        default="turns_agent",
        help="the program: the sync openai client (in a thread) or the async one",
    )
    parser.add_argument(
        "--client-per-episode",
        action="store_true",
        help="each episode's program builds its own HTTP client (as a naive agent does)",
    )
    args = parser.parse_args()
    TURNS, CLIENT_PER_EPISODE = args.turns, args.client_per_episode
    model_dir = ensure_tiny_model(Path(tempfile.gettempdir()) / "opentinker-bench-tiny-qwen2")
    engine = CountingEngine(
        TransformersEngine.load(ModelSpec(base_model=str(model_dir), finetune="full"))
    )
    loops = {name: path_loop(engine, args, name == "endpoint") for name in PATHS}
    figures = asyncio.run(run_rounds(loops, args, engine))
    print(
        f"{args.episodes} episodes x {TURNS} turns x <= {args.new_tokens} tokens, tiny model, "
        f"agent {args.agent}{' (a client per episode)' if CLIENT_PER_EPISODE else ''}, "
        f"{args.rounds} rounds"
    )
    for name, f in figures.items():
        print(
            f"{name:>10}: {statistics.median(f['rate']):7.2f} episodes/s (median), "
            f"{statistics.mean(f['tokens']):.1f} model tokens per episode, "
            f"{statistics.mean(f['calls']):.1f} engine calls per batch, "
            f"engine busy {statistics.median(f['busy']):.0%}"
        )
    ratios = [
        e / r
        for e, r in zip(figures["endpoint"]["rate"], figures["reset/step"]["rate"], strict=True)
    ]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    print(
        f"endpoint / reset-step: median {statistics.median(ratios):.2f}x, spread "
        f"{min(ratios):.2f}-{max(ratios):.2f}x (quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f}x) "
        f"over {args.rounds} rounds (target >= 0.8x)"
    )


if __name__ == "__main__":
    main()
