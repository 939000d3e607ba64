"""The session's trainer side in-process: a real tiny model, a real rollout server for the
sampler; gradient accumulation, exact resume, ordering, data checks, and faults (a cancelled
call, an unreachable scheduler, a broken weight sync)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from async_guard import run
from identity_helpers import user_key

from opentinker import training_session as sdk
from opentinker.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from opentinker.jobs import JobInfo
from opentinker.services.common.auth import OwnCredentialAuthenticator
from opentinker.services.common.grpc_server import aio_channel
from opentinker.services.launcher.redis_process import free_port
from opentinker.services.rollout.service import create_server as create_rollout
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.trainer.errors import RolloutError
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.reporter import SchedulerReporter
from opentinker.services.trainer.service import create_session_server
from opentinker.services.trainer.session.data import Datum, collate_data
from opentinker.services.trainer.session.objective import LossSpec
from opentinker.services.trainer.session.ordering import CallOrder
from opentinker.services.trainer.session.sampler import SessionSampler
from opentinker.services.trainer.session.servicer import adam_from_proto
from opentinker.services.trainer.session.training_session import (
    AdamParams,
    StepReport,
    TrainingSession,
)
from opentinker.services.trainer.settings import TrainerSettings
from opentinker.session_config import SessionConfig
from opentinker.spec import JobSpec, ModelSpec, to_proto
from opentinker.trainer.v1 import trainer_pb2, trainer_pb2_grpc

pytestmark = pytest.mark.integration
CE = LossSpec("cross_entropy")
ADAM = AdamParams(learning_rate=1e-2, weight_decay=0.01)
NAN, INF = float("nan"), float("inf")


def datum(tokens: list[int], weights: list[float] | None = None) -> Datum:
    return Datum(tokens[:-1], tokens[1:], weights=weights or [])


D1 = datum([5, 9, 17, 33, 2], [0.0, 1.0, 1.0, 0.5])
D2 = datum([7, 8, 40, 41, 42, 43, 3], [1.0, 0.0, 1.0, 1.0, 1.0, 2.0])


@contextlib.asynccontextmanager
async def session_on(
    model: Path,
    root: Path,
    *,
    job_id: str = "job-a",
    finetune: str = "lora",
    report_step: StepReport | None = None,
) -> AsyncIterator[TrainingSession]:
    """A TrainingSession on ``model`` with its sampler on a real in-process rollout."""
    spec = ModelSpec(base_model=str(model), finetune=finetune)  # type: ignore[arg-type]
    key = user_key()
    server, port = await create_rollout(RolloutSettings(credential=key, port=0, device="cpu"))
    address = f"127.0.0.1:{port}"
    try:
        async with aio_channel(address, credential=key) as channel:
            policy = await asyncio.to_thread(Policy, spec, learning_rate=1e-3, seed=0)
            sampler = SessionSampler(channel, address=address, tolerance=1e-3)
            pb = to_proto(JobSpec(kind="session", model=spec)).model
            await sampler.open(job_id=job_id, model=pb, seed=0, timeout_s=60)
            try:
                yield TrainingSession(
                    job_id=job_id,
                    tenant_id="acme",
                    policy=policy,
                    sampler=sampler,
                    config=SessionConfig(),
                    checkpoint_root=root,
                    settings=TrainerSettings(),
                    report_step=report_step,
                )
            finally:
                await sampler.close(reason="test over", timeout_s=5)
    finally:
        await server.stop(grace=0.5)


def grads(session: TrainingSession) -> list[torch.Tensor]:
    return [p.grad.clone() for p in session.policy.trainable_parameters()]


def test_clip_fraction_counts_the_positions_with_an_advantage(letter_model_dir, tmp_path) -> None:
    """On-policy (sampling logprobs as the policy's own), nothing is clipped: the prompt's
    positions (advantage 0, sampling logprob 0; their ratio exp(logp) far below 0.8) counted
    as clipped, 0.5 for half a datum of prompt."""

    async def main() -> None:
        async with session_on(letter_model_dir, tmp_path, finetune="full") as session:
            ids = [1, 2, 3, 4, 5, 6]
            probe = Datum(ids[:-1], ids[1:], weights=[1.0] * 5)
            own = (await session.forward([probe], CE)).logprobs[0]
            prompt = 2  # the first two targets are the prompt's
            sampled = [0.0] * prompt + own[prompt:]
            advantages = [0.0] * prompt + [1.0] * (5 - prompt)
            datum = Datum(ids[:-1], ids[1:], sampling_logprobs=sampled, advantages=advantages)
            for loss in ("ppo", "cispo"):
                out = await session.forward([datum], LossSpec(loss))  # type: ignore[arg-type]
                assert out.metrics["clip_fraction"] == 0.0, (loss, out.metrics)

    asyncio.run(main())


def test_gradients_of_two_calls_equal_one_call_on_both(letter_model_dir, tmp_path) -> None:
    async def main() -> None:
        async with session_on(letter_model_dir, tmp_path, finetune="full") as split:
            first = await split.forward_backward([D1], CE)
            second = await split.forward_backward([D2], CE)
            assert split.accumulated_calls == 2
            split_grads = grads(split)
        async with session_on(letter_model_dir, tmp_path, finetune="full") as whole:
            both = await whole.forward_backward([D1, D2], CE)
            assert both.loss.item() == pytest.approx(first.loss.item() + second.loss.item())
            for a, b in zip(split_grads, grads(whole), strict=True):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
            step, grad_norm = await whole.optim_step(ADAM)
            assert step == 1 and grad_norm > 0 and whole.accumulated_calls == 0
            with pytest.raises(FailedPreconditionError, match="forward_backward first"):
                await whole.optim_step(ADAM)

    asyncio.run(main())


def test_state_loaded_in_a_new_session_gives_the_same_next_steps(
    letter_model_dir, tmp_path
) -> None:
    async def train_step(s: TrainingSession, data: list[Datum]) -> float:
        loss = (await s.forward_backward(data, CE)).loss.item()
        await s.optim_step(ADAM)
        return loss

    async def main() -> None:
        async with session_on(letter_model_dir, tmp_path, job_id="job-a") as a:
            for _ in range(2):
                await train_step(a, [D1, D2])
            path = await a.save_state("after-2")
            expected = [await train_step(a, [D1, D2]) for _ in range(2)]
        async with session_on(letter_model_dir, tmp_path, job_id="job-b") as b:
            assert await b.load_state(str(path)) == 2
            got = [await train_step(b, [D1, D2]) for _ in range(2)]
            # The second loss follows an AdamW step: equal only if the moments were restored.
            assert got == pytest.approx(expected, abs=1e-6), (got, expected)
            assert b.step == 4
            b.tenant_id = "globex"  # another tenant cannot load it, nor learn it exists
            with pytest.raises(NotFoundError):
                await b.load_state(str(path))
            with pytest.raises(NotFoundError):
                await b.load_state(str(tmp_path.parent))

    asyncio.run(main())


def test_an_unreachable_scheduler_neither_fails_nor_holds_up_an_applied_step(
    letter_model_dir, tmp_path
) -> None:
    """The step report goes out behind the step: optim_step answers at once with the step it
    applied; the report that finally fails ends the session at the next step, before it moves
    the weights (so the client is never told a step failed that was applied)."""

    async def main() -> None:
        address = f"127.0.0.1:{free_port()}"  # the scheduler: nothing listens there
        async with aio_channel(address) as channel:
            reporter = SchedulerReporter(
                channel, address=address, job_id="job-a", attempt=1, timeout_s=1, retry_for_s=2
            )
            async with session_on(
                letter_model_dir, tmp_path, report_step=reporter.report_step
            ) as s:
                await s.forward_backward([D1, D2], CE)
                step, grad_norm = await asyncio.wait_for(s.optim_step(ADAM), 1.5)
                assert (step, s.step) == (1, 1) and grad_norm > 0
                await s.flush_reports()  # the report gives up after retry_for_s
                assert s.ended.is_set() and "step report" in s.end_reason
                await s.forward_backward([D1], CE)
                weights = [p.detach().clone() for p in s.policy.trainable_parameters()]
                with pytest.raises(UnavailableError, match="step report"):
                    await s.optim_step(ADAM)
                assert s.step == 1
                for before, now in zip(weights, s.policy.trainable_parameters(), strict=True):
                    assert torch.equal(before, now)

    run(main, 60)


def test_a_call_cancelled_mid_step_finishes_before_the_next_call_and_is_counted(
    letter_model_dir, tmp_path
) -> None:
    """The client gives up on a forward_backward (deadline, cancel) while the model works:
    the work still finishes in its worker thread and its gradients stay. The session counts
    it and the next call waits for it; it used to return at once, uncounted
    (accumulated_calls 0 with its gradients in place), and let the next call run alongside."""
    token = "otj_0123456789ab_" + "x" * 24  # the job's own token

    async def main() -> None:
        async with session_on(letter_model_dir, tmp_path) as session:
            settings = TrainerSettings(host="127.0.0.1", port=0)
            own = OwnCredentialAuthenticator(token, job_id="job-a", attempt=1)
            server, port = await create_session_server(settings, session, own)
            try:
                async with aio_channel(f"127.0.0.1:{port}", credential=token) as channel:
                    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                    await cancelled_mid_step(stub, session)
                    small = fb_request(2, [D1])
                    reply = await stub.ForwardBackward(small, timeout=60)
                    info = await stub.GetSessionInfo(
                        trainer_pb2.GetSessionInfoRequest(session_id="job-a"), timeout=10
                    )
                    assert (reply.accumulated_calls, info.accumulated_calls) == (2, 2)
                    assert info.last_seq == 2
            finally:
                await server.stop(grace=0.5)

    run(main, 120)


def fb_request(seq: int, data: list[Datum]) -> trainer_pb2.ForwardBackwardRequest:
    return trainer_pb2.ForwardBackwardRequest(
        call=trainer_pb2.SessionCall(session_id="job-a", seq=seq),
        data=[
            trainer_pb2.Datum(input_tokens=d.input_tokens, target_tokens=d.target_tokens)
            for d in data
        ],
        loss=trainer_pb2.LossConfig(loss=trainer_pb2.SESSION_LOSS_CROSS_ENTROPY),
    )


async def cancelled_mid_step(stub: trainer_pb2_grpc.TrainerServiceStub, session) -> None:
    """Send a large forward_backward as call 1 and cancel it once the session works on it."""
    tokens = [(7 * i) % 500 + 1 for i in range(257)]
    call = stub.ForwardBackward(fb_request(1, [datum(tokens)] * 24), timeout=60)
    while session.idle_seconds() > 0:  # 0 once the call is in (its thread starts at once)
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.05)  # well inside the model work, which takes about a second
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


def test_a_weight_sync_that_broke_the_stream_is_retried_on_a_fresh_one(
    letter_model_dir, tmp_path
) -> None:
    """A save_weights_for_sampler that times out (or whose rollout stream breaks mid-transfer)
    cancels the sampler's rollout stream. The next one opens a fresh stream and succeeds;
    every later one used to fail with 'CANCELLED: Locally cancelled by application!'."""

    async def main() -> None:
        async with session_on(letter_model_dir, tmp_path) as s:
            with pytest.raises(RolloutError):
                await s.sampler.publish(s.policy, timeout_s=0.001)  # gives up mid-transfer
            assert s.sampler.policy_version == 0
            await s.forward_backward([D1, D2], CE)
            await s.optim_step(AdamParams(learning_rate=0.1))
            version, diff = await s.save_weights_for_sampler()
            assert version == 1 and diff <= 1e-3  # the new weights, verified by the probe
            from opentinker.common.v1 import common_pb2

            sampling = common_pb2.SamplingParams(max_new_tokens=3)
            samples, used = await s.sample(
                [5, 9, 17], num_samples=1, sampling=sampling, stop_token_ids=[], seed=1, seq=1
            )
            assert used == 1 and len(samples) == 1

    run(main, 120)


def test_sampler_serves_the_saved_weights_and_keeps_stop_tokens(letter_model_dir, tmp_path):
    async def main() -> None:
        async with session_on(letter_model_dir, tmp_path) as s:
            await s.forward_backward([D1, D2], CE)
            await s.optim_step(AdamParams(learning_rate=0.1))
            version, diff = await s.save_weights_for_sampler()
            assert version == 1 and diff <= 1e-3
            from opentinker.common.v1 import common_pb2

            sampling = common_pb2.SamplingParams(max_new_tokens=5)
            vocab = s.policy.model.get_input_embeddings().num_embeddings
            samples, used = await s.sample(
                [5, 9, 17], num_samples=3, sampling=sampling, stop_token_ids=[], seed=1, seq=1
            )
            assert used == 1 and len(samples) == 3
            for sample in samples:
                assert len(sample.tokens) == len(sample.logprobs) <= 5
                assert all(lp <= 0 for lp in sample.logprobs)
            stopped, _ = await s.sample(
                [5, 9, 17],
                num_samples=2,
                sampling=sampling,
                stop_token_ids=list(range(vocab)),  # every token stops: one token, kept
                seed=1,
                seq=2,
            )
            assert [len(x.tokens) for x in stopped] == [1, 1] and all(x.stopped for x in stopped)

    asyncio.run(main())


def test_calls_run_in_seq_order_and_a_repeated_seq_is_refused() -> None:
    async def main() -> None:
        order = CallOrder(wait_s=5)
        ran: list[int] = []

        async def call(seq: int) -> None:
            async with order.turn(seq):
                ran.append(seq)

        await asyncio.gather(call(3), call(2), call(1))  # arrive backwards, run in order
        assert ran == [1, 2, 3]
        with pytest.raises(FailedPreconditionError, match="out of order"):
            await call(2)
        late = CallOrder(wait_s=0.1)
        with pytest.raises(FailedPreconditionError, match="never came"):
            async with late.turn(2):
                pass

    asyncio.run(main())


@pytest.mark.parametrize(
    ("data", "loss", "message"),
    [
        ([D1, Datum([1, 2], [9])], "cross_entropy", r"data\[1\]: target_tokens has 1 ids"),
        ([Datum([1, 2], [2, 3], weights=[1.0])], "cross_entropy", r"data\[0\]: weights has 1"),
        ([D1], "ppo", r"data\[0\]: loss 'ppo' needs sampling_logprobs"),
        ([Datum([1, 999], [999, 3])], "cross_entropy", "outside the vocabulary"),
        ([], "cross_entropy", "data is empty"),
        # Not finite: one NaN makes the loss and every gradient NaN, and optim_step would
        # write NaN into every trained weight of the session.
        (
            [
                Datum([1, 2], [2, 3], sampling_logprobs=[-1.0, -1.0], advantages=[1.0, 1.0]),
                Datum([1, 2], [2, 3], sampling_logprobs=[-1.0, -1.0], advantages=[1.0, NAN]),
            ],
            "importance_sampling",
            r"data\[1\]: advantages\[1\] is nan",
        ),
        ([Datum([1, 2], [2, 3], weights=[INF, 1.0])], "cross_entropy", r"weights\[0\] is inf"),
        # Weights left out (all 1): its KL term fitted the prompt's tokens too
        (
            [Datum([1, 2], [2, 3], sampling_logprobs=[0.0, -1.0], advantages=[0.0, 1.0])],
            "stable_reinforce",
            r"data\[0\]: loss 'stable_reinforce' needs weights",
        ),
        (
            [Datum([1, 2], [2, 3], sampling_logprobs=[NAN, -1.0], advantages=[1.0, 1.0])],
            "ppo",
            r"data\[0\]: sampling_logprobs\[0\] is nan",
        ),
    ],
)
def test_bad_data_is_refused_naming_the_datum_and_field(data, loss, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        collate_data(data, loss, pad_id=0, vocab_size=512, max_tokens=1000)


@pytest.mark.parametrize(
    ("adam", "message"),
    [
        # Each of these passed and wrote NaN (or inf) into every trained weight at the step.
        (AdamParams(learning_rate=INF), "adam.learning_rate must be finite and > 0, got inf"),
        (AdamParams(learning_rate=1e-3, weight_decay=NAN), "adam.weight_decay must be"),
        (AdamParams(learning_rate=1e-3, grad_clip_norm=NAN), "adam.grad_clip_norm must be"),
        (AdamParams(learning_rate=1e-3, eps=INF), "adam.eps must be"),
        (AdamParams(learning_rate=NAN), "adam.learning_rate must be"),
        (AdamParams(learning_rate=1e-3, beta2=1.0), r"adam.beta2 must be in \[0, 1\)"),
    ],
)
def test_adam_params_that_would_corrupt_the_weights_are_refused(adam, message) -> None:
    with pytest.raises(InvalidArgumentError, match=message) as info:
        adam.check()
    assert info.value.reason == "BAD_ADAM_PARAMS"


def test_adam_settings_of_zero_on_the_wire_are_kept_and_unset_ones_default() -> None:
    """beta1 = 0 (no momentum) is a valid AdamW setting: the servicer read ``a.beta1 or 0.9``,
    so a 0 sent by a client (Tinker's adam_params through the gateway too) became 0.9."""
    wire = sdk.AdamParams(learning_rate=1e-3, beta1=0.0, beta2=0.0).__dict__  # as the SDK sends
    sent = trainer_pb2.AdamParams(**wire)
    assert (adam_from_proto(sent).beta1, adam_from_proto(sent).beta2) == (0.0, 0.0)
    unset = adam_from_proto(trainer_pb2.AdamParams(learning_rate=1e-3))
    assert (unset.beta1, unset.beta2, unset.eps) == (0.9, 0.95, 1e-8)
    with pytest.raises(InvalidArgumentError, match="adam.eps must be finite and > 0, got 0"):
        adam_from_proto(trainer_pb2.AdamParams(learning_rate=1e-3, eps=0.0)).check()


def test_a_call_refused_by_the_sdk_before_sending_leaves_the_session_usable(
    letter_model_dir, tmp_path
) -> None:
    """A call the SDK itself refuses (a misspelt loss, an unknown loss option) is never sent,
    so it must not use up a seq: it did, and every later call of the session waited for that
    seq, which never came, and failed (OUT_OF_ORDER after order_wait_s)."""
    token = "otj_0123456789ab_" + "x" * 24

    async def main() -> None:
        async with session_on(letter_model_dir, tmp_path) as session:
            settings = TrainerSettings(host="127.0.0.1", port=0)
            own = OwnCredentialAuthenticator(token, job_id="job-a", attempt=1)
            server, port = await create_session_server(settings, session, own)
            endpoint = f"127.0.0.1:{port}"
            job = JobInfo("job-a", "s", "RUNNING", "", 1, "w", "", 0.0, 0.0, {}, endpoint)
            client = sdk.TrainingSession(job, api_key=token, timeout=20, on_close=lambda: None)
            data = [sdk.Datum.from_sequence([5, 9, 17, 33, 2])]
            try:
                with pytest.raises(ValueError, match="loss_fn must be one of"):
                    await asyncio.to_thread(client.forward_backward, data, "crossentropy")  # type: ignore[arg-type]
                with pytest.raises(ValueError, match="unknown loss option"):
                    await asyncio.to_thread(client.forward_backward, data, clip=0.2)
                out = await asyncio.to_thread(client.forward_backward, data, "cross_entropy")
                assert len(out.logprobs[0]) == 4
            finally:
                client._worker.shutdown(wait=False)
                client._conn.close()
                await server.stop(grace=0.5)

    run(main, 120)
