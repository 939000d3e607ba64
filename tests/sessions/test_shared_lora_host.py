"""Shared LoRA host: two tenants' sessions of different ranks train at once, interleaved on one
base, and each ends bit-for-bit where the same session trained alone ends (adapter weights,
AdamW state, losses); no gradient reaches the other adapter or the base; turns are fair."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import grpc
import pytest
import torch

from opentinker.errors import FailedPreconditionError, InvalidArgumentError
from opentinker.services.trainer.session.data import Datum
from opentinker.services.trainer.session.host import SharedLoraHost
from opentinker.services.trainer.session.host_turns import FairTurns
from opentinker.services.trainer.session.objective import LossSpec
from opentinker.services.trainer.session.sampler import SessionSampler
from opentinker.services.trainer.session.training_session import (
    AdamParams,
    StepReport,
    TrainingSession,
)
from opentinker.services.trainer.settings import TrainerSettings
from opentinker.session_config import SessionConfig
from opentinker.spec import LoraConfig, ModelSpec

pytestmark = pytest.mark.integration
CE = LossSpec("cross_entropy")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def datum(tokens: list[int]) -> Datum:
    return Datum(tokens[:-1], tokens[1:])


DATA = [datum([5, 9, 17, 33, 2, 8]), datum([7, 8, 40, 41, 42, 43, 3]), datum([11, 12, 13, 14])]


def specs(base: Path) -> dict[str, ModelSpec]:
    """Tenant a: rank 4 on attention; tenant b:
    rank 8 on attention, MLP and the unembedding. Both with dropout: their RNGs must stay
    their own."""
    lora_a = LoraConfig(rank=4, alpha=8.0, dropout=0.1, target_modules=ATTENTION)
    lora_b = LoraConfig(
        rank=8, alpha=16.0, dropout=0.05, target_modules=(*ATTENTION, *MLP, "lm_head")
    )
    return {
        "a": ModelSpec(base_model=str(base), lora=lora_a),
        "b": ModelSpec(base_model=str(base), lora=lora_b),
    }


def hosted(
    host: SharedLoraHost,
    session_id: str,
    spec: ModelSpec,
    seed: int,
    root: Path,
    report_step: StepReport | None = None,
) -> TrainingSession:
    """A TrainingSession whose model work runs in its turns on ``host``. Its sampler is
    never called here (no sampling in these tests): a channel to nowhere."""
    tenant = host.add_session(session_id, spec, seed=seed)
    channel = grpc.aio.insecure_channel("127.0.0.1:9")
    return TrainingSession(
        job_id=session_id,
        tenant_id=f"tenant-{session_id}",
        policy=tenant,  # type: ignore[arg-type]  # a Policy's duck: host_tenant.py
        sampler=SessionSampler(channel, address="127.0.0.1:9", tolerance=1e-3),
        config=SessionConfig(seed=seed),
        checkpoint_root=root,
        settings=TrainerSettings(),
        run_work=functools.partial(host.run, session_id),
        report_step=report_step,
    )


async def train(session: TrainingSession, order: list[int]) -> list[float]:
    """Three steps, each of forward_backward over ``order``'s data then optim_step."""
    losses = []
    for step in range(3):
        for i in order:
            out = await session.forward_backward([DATA[i]], CE)
            losses.append(float(out.loss.detach()))
        await session.optim_step(AdamParams(learning_rate=1e-2 * (step + 1), weight_decay=0.01))
    return losses


def end_state(session: TrainingSession) -> dict[str, torch.Tensor]:
    """The session's adapter weights and every AdamW state tensor, copied."""
    out = {f"w:{n}": t.clone() for n, t in session.policy.trainable_state().items()}
    for i, state in session.policy.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            out[f"opt:{i}:{key}"] = torch.as_tensor(value).clone()
    return out


ORDERS = {"a": [0, 1], "b": [2, 0, 1]}
SEEDS = {"a": 3, "b": 4}


def test_two_ranks_interleaved_equal_each_alone(letter_model_dir: Path, tmp_path: Path) -> None:
    spec = specs(letter_model_dir)

    async def alone(key: str):
        host = SharedLoraHost(str(letter_model_dir))
        session = hosted(host, key, spec[key], SEEDS[key], tmp_path)
        return await train(session, ORDERS[key]), end_state(session)

    async def together():
        host = SharedLoraHost(str(letter_model_dir))
        sessions = {k: hosted(host, k, spec[k], SEEDS[k], tmp_path) for k in ("a", "b")}
        results = await asyncio.gather(*(train(sessions[k], ORDERS[k]) for k in ("a", "b")))
        usage = {k: host.usage(k) for k in ("a", "b")}
        return (
            dict(zip("ab", results, strict=True)),
            {k: end_state(s) for k, s in sessions.items()},
            usage,
        )

    async def main() -> None:
        losses, states, usage = await together()
        # Interleaved for real: each session's units ran (6 and 9 forward_backward + 3 steps).
        assert usage["a"].units == 3 * 2 + 3 and usage["b"].units == 3 * 3 + 3
        assert usage["a"].busy_s > 0 and usage["b"].busy_s > 0
        for key in ("a", "b"):
            alone_losses, alone_state = await alone(key)
            assert losses[key] == alone_losses, key
            assert states[key].keys() == alone_state.keys()
            for name, value in alone_state.items():
                assert torch.equal(states[key][name], value), (key, name)
        ranks = {k: states[k][next(n for n in states[k] if "lora_A" in n)].shape[0] for k in "ab"}
        assert ranks == {"a": 4, "b": 8}
        assert any("mlp.down_proj" in n for n in states["b"]) and any(
            "lm_head" in n for n in states["b"]
        )
        assert not any("mlp" in n for n in states["a"])

    asyncio.run(main())


def test_no_gradient_reaches_the_other_adapter_or_the_base(
    letter_model_dir: Path, tmp_path: Path
) -> None:
    spec = specs(letter_model_dir)

    async def main() -> None:
        host = SharedLoraHost(str(letter_model_dir))
        a = hosted(host, "a", spec["a"], 3, tmp_path)
        b = hosted(host, "b", spec["b"], 4, tmp_path)
        await a.forward_backward([DATA[0]], CE)
        assert all(p.grad is not None for p in a.policy.trainable_parameters())
        assert all(p.grad is None for p in b.policy.trainable_parameters())
        assert host.model is not None
        own = {id(p) for s in (a, b) for p in s.policy.trainable_parameters()}
        base = [p for p in host.model.parameters() if id(p) not in own]
        assert base and all(p.grad is None and not p.requires_grad for p in base)
        grads_a = [p.grad.clone() for p in a.policy.trainable_parameters()]
        await b.forward_backward([DATA[1]], CE)
        await b.optim_step(AdamParams(learning_rate=1e-2))
        assert all(
            torch.equal(p.grad, g)
            for p, g in zip(a.policy.trainable_parameters(), grads_a, strict=True)
        )
        assert all(p.grad is None for p in base)

    asyncio.run(main())


def test_each_step_reports_its_model_seconds_and_turn_wait(
    letter_model_dir: Path, tmp_path: Path
) -> None:
    """Accounting per tenant: each step's metrics carry the tokens it trained, the seconds of
    model work its calls took and the seconds they waited for other sessions' turns."""
    spec = specs(letter_model_dir)
    reports: dict[str, list[dict[str, float]]] = {"a": [], "b": []}

    def reporter(key: str) -> StepReport:
        async def report(step: int, version: int, metrics, env_error_reason: str = "") -> bool:  # noqa: ANN001
            reports[key].append(dict(metrics))
            return False

        return report

    async def main() -> None:
        host = SharedLoraHost(str(letter_model_dir))
        sessions = [hosted(host, k, spec[k], 1, tmp_path, reporter(k)) for k in ("a", "b")]

        async def one_step(session: TrainingSession) -> None:
            await session.forward_backward([DATA[0], DATA[1]], CE)
            await session.optim_step(AdamParams(learning_rate=1e-3))
            await session.flush_reports()

        await asyncio.gather(*(one_step(s) for s in sessions))

    asyncio.run(main())
    (a,), (b,) = reports["a"], reports["b"]
    assert a["tokens_trained"] == b["tokens_trained"] == 5 + 6
    assert a["model_s"] > 0 and b["model_s"] > 0
    # b's forward_backward waited for a's (round-robin: a queued first), at least its length.
    assert b["turn_wait_s"] > 0.25 * a["model_s"], (a, b)


def test_host_refuses_full_other_base_and_more_than_room(
    letter_model_dir: Path, tmp_path: Path
) -> None:
    host = SharedLoraHost(str(letter_model_dir), max_sessions=1)
    lora = ModelSpec(base_model=str(letter_model_dir))
    with pytest.raises(InvalidArgumentError, match="whole device"):
        host.add_session("f", ModelSpec(base_model=str(letter_model_dir), finetune="full"), seed=0)
    with pytest.raises(InvalidArgumentError, match="not this host's base"):
        host.add_session("o", ModelSpec(base_model=str(tmp_path)), seed=0)
    host.add_session("x", lora, seed=0)
    with pytest.raises(FailedPreconditionError, match="full"):
        host.add_session("y", lora, seed=0)
    host.remove_session("x")
    assert host.model is None and host.room == 1
    host.add_session("y", lora, seed=0)  # the base alone again takes a new first adapter


def test_turns_are_round_robin_across_sessions() -> None:
    """a queues three units, then b and c one each: b and c run before a's second and third."""
    ran: list[str] = []

    async def main() -> None:
        turns = FairTurns(lambda key, fn: fn())
        work = [turns.run(key, functools.partial(ran.append, key)) for key in "aaabc"]
        await asyncio.gather(*work)

    asyncio.run(main())
    assert ran == ["a", "b", "c", "a", "a"]
