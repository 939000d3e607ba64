"""Fixtures of every group: one real redis-server per test session, tiny models, identities.

The tests are grouped by service or tier (scheduler/, worker/, trainer/, sessions/, rollout/,
envhub/, e2e/, sdk/, project/); a fixture only one group uses lives in that group's
conftest.py, and the helpers every group imports live in support/ (on pytest's pythonpath).

- ``redis_server_url`` (session): the URL of a real ``redis-server`` started once for the whole
  session in a temporary folder (services.launcher.redis_process.RedisProcess).
- ``redis_url`` (function): the same URL, with database 0 emptied (FLUSHDB) before the test,
  so each test starts from a clean Redis. Use this one in tests.
- ``letter_model_dir`` (session): the tiny Qwen2 nudged to answer with some letter A..D.
- ``structlog_config_restored`` (autouse): each test leaves structlog as it found it.
- ``identities`` (session): a real scheduler whose IdentityService checks credentials for
  EnvHub servers started by tests, with API keys of two tenants, an admin key and a worker
  token (tests/support/identity_service.py).

Async tests here are plain functions that call ``asyncio.run(...)``; no plugin is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from opentinker.services.launcher.redis_process import RedisProcess

# Services run in the test process log through structlog's default configuration, whose
# console renderer draws a traceback with rich, every frame's locals included: seconds of CPU
# on this 2-core machine, inside the event loop that serves the test's calls. A scheduler
# whose Redis was just killed logs one such traceback, and the test's GetJob, answered
# UNAVAILABLE once that was drawn, ran past its 5 s deadline (3 of 6 runs). The same
# renderer, with plain tracebacks (as the services' own configure_logging writes them).
_DEFAULTS = structlog.get_config()["processors"]
structlog.configure(
    processors=[
        *_DEFAULTS[:-1],
        structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback),
    ]
)


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data_dir: Path = tmp_path_factory.mktemp("redis")
    with RedisProcess(data_dir) as server:
        yield server.url


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    import redis  # server-side dependency; imported here so SDK-only tests never need it

    client = redis.Redis.from_url(redis_server_url)
    try:
        client.flushdb()
    finally:
        client.close()
    return redis_server_url


@pytest.fixture(autouse=True)
def structlog_config_restored() -> Iterator[None]:
    """structlog's configuration as it was before each test: a CLI a test runs in-process
    (``opentinker infer --local`` sets WARNING for its process) would otherwise filter the
    log events later tests look for."""
    import structlog

    saved = structlog.get_config()
    try:
        yield
    finally:
        structlog.configure(**saved)


@pytest.fixture(scope="session", autouse=True)
def identities(redis_server_url: str):
    """Also sets, for the session, the two variables a user of the SDK sets:
    OPENTINKER_API_KEY (tenant acme's user key; what ``serve()``, ``Client`` and the CLI send by
    default) and OPENTINKER_SCHEDULER_ADDRESS (where EnvHubs started by tests check
    credentials). Tests of other meshes pass their own keys explicitly."""
    import os

    from identity_service import session_identity_service

    with session_identity_service(redis_server_url) as found:
        saved = {
            k: os.environ.get(k) for k in ("OPENTINKER_API_KEY", "OPENTINKER_SCHEDULER_ADDRESS")
        }
        os.environ["OPENTINKER_API_KEY"] = found.user_key
        os.environ["OPENTINKER_SCHEDULER_ADDRESS"] = found.scheduler_address
        try:
            yield found
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture(scope="session")
def letter_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random-init tiny Qwen2, nudged (supervised, a few steps) to answer with *some*
    letter A..D whatever the question — like a pretrained model that knows the answer format —
    so `letter` rewards are mixed (~1/4 with 4 letters) and GRPO has signal from step one.
    Saved with save_pretrained, loaded by everyone through from_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opentinker.services.envhub.games.letter_env import LetterGame
    from opentinker.services.modeling.tiny_model import ensure_tiny_model

    random_init = ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")
    tokenizer = AutoTokenizer.from_pretrained(random_init)
    model = AutoModelForCausalLM.from_pretrained(random_init, dtype=torch.float32)
    torch.manual_seed(0)
    system = LetterGame().get_system_prompt()
    prompts = [
        tokenizer.apply_chat_template(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Answer with the letter {k}."},
            ],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for k in "ABCD"
    ]
    assert len({len(p) for p in prompts}) == 1, "letters must tokenize alike"
    ids_B_L = torch.tensor([list(p) for p in prompts])
    letters = torch.tensor([tokenizer.convert_tokens_to_ids(k) for k in "ABCD"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(8):  # first answer token: uniform over A..D, whatever the question
        logp_B_V = torch.log_softmax(model(input_ids=ids_B_L).logits[:, -1], -1)
        loss = -logp_B_V[:, letters].logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = tmp_path_factory.mktemp("models") / "tiny-qwen2-letters"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 - pytest's reporter
    """The fault and load report (tests/support/fault_report.py), when those tests ran."""
    from fault_report import summary_lines

    lines = summary_lines()
    if lines:
        terminalreporter.section("faults and load")
        for line in lines:
            terminalreporter.write_line(line)
