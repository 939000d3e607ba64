"""Samplers are snapshots: a Tinker sampling client samples the weights it was made from for
as long as it lives, however far its training client trains after (the cookbook's DPO
reference, async RL's older samplers, a KL to an old policy all rely on it)."""

from __future__ import annotations

import pytest
import tinker
from tinker import types
from tinker_gateway_helpers import (
    BASE,
    gateway,
    mesh,
    monkeypatch_module,
    service,
    service_client,
    sft_datum,
)

import opentinker
from opentinker.admin import AdminClient
from opentinker.connection import Connection
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.services.scheduler.tenants.bootstrap import ADMIN_KEY_FILE

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["gateway", "mesh", "monkeypatch_module", "service"]  # fixtures used here

SCORED = [5, 9, 13, 17, 21, 25]


def logprobs(sampler: tinker.SamplingClient) -> list[float]:
    return sampler.compute_logprobs(types.ModelInput.from_ints(SCORED)).result()[1:]


def test_an_old_sampler_keeps_its_weights_while_training_goes_on(service) -> None:
    trainer = service.create_lora_training_client(base_model=BASE, rank=4).result()
    reference = trainer.save_weights_and_get_sampling_client().result()  # DPO's reference
    named = trainer.save_weights_for_sampler("v0").result().path
    before = logprobs(reference)
    trainer_before = trainer.forward([sft_datum(SCORED)], "cross_entropy").result()
    assert before == pytest.approx(trainer_before.loss_fn_outputs[0]["logprobs"].tolist(), abs=2e-3)

    adam = types.AdamParams(learning_rate=1e-1)
    for _ in range(5):
        trainer.forward_backward([sft_datum(SCORED)], "cross_entropy").result()
        trainer.optim_step(adam).result()
    newer = trainer.save_weights_and_get_sampling_client().result()
    after = logprobs(newer)
    # Five steps on this very sequence moved its logprobs a lot (training works) ...
    assert max(abs(a - b) for a, b in zip(after, before, strict=True)) > 0.5
    trained = trainer.forward([sft_datum(SCORED)], "cross_entropy").result()
    assert after == pytest.approx(trained.loss_fn_outputs[0]["logprobs"].tolist(), abs=2e-3)
    # ... while the samplers made before them still answer with the initial weights: the
    # reference, one made now from the named path, and the reference again after the newer
    # sampler was used (each swap is a verified weight sync).
    assert logprobs(reference) == pytest.approx(before, abs=1e-4)
    from_path = service.create_sampling_client(model_path=named).result()
    assert logprobs(from_path) == pytest.approx(before, abs=1e-4)
    assert logprobs(newer) == pytest.approx(after, abs=1e-4)
    assert logprobs(reference) == pytest.approx(before, abs=1e-4)
    # Sampling (not only scoring) follows the snapshot too: seeded greedy-ish draws of the
    # old and new weights come from their own distributions (their logprobs differ).
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    prompt = types.ModelInput.from_ints(SCORED[:3])
    old = reference.sample(prompt, 1, params).result().sequences[0]
    new = newer.sample(prompt, 1, params).result().sequences[0]
    assert old.logprobs != new.logprobs
    # Temperature 0 (the cookbook's greedy evals) is argmax decoding: any seed, same tokens.
    greedy = [
        newer.sample(prompt, 2, types.SamplingParams(max_tokens=4, temperature=0.0, seed=s))
        .result()
        .sequences
        for s in (1, 2)
    ]
    assert len({tuple(seq.tokens) for draw in greedy for seq in draw}) == 1


def test_named_sampler_weights_stay_sampleable_after_their_run_ended(gateway, mesh) -> None:
    with service_client(gateway, mesh.api_key) as run:
        trainer = run.create_lora_training_client(base_model=BASE, rank=4).result()
        trainer.forward_backward([sft_datum(SCORED)], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-1)).result()
        named = trainer.save_weights_for_sampler("kept").result().path
        expected = logprobs(run.create_sampling_client(model_path=named).result())
    # The client closed: its run's session job has ended ...
    job_id = named.removeprefix("tinker://").split("/")[0]
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client:
        assert client.get_job(job_id).state == "SUCCEEDED"
    # ... and its named sampler weights are loaded on demand, for their owner only.
    with service_client(gateway, mesh.api_key) as later:
        sampler = later.create_sampling_client(model_path=named).result()
        assert sampler.get_base_model() == BASE
        assert logprobs(sampler) == pytest.approx(expected, abs=2e-3)
        checkpoints = later.create_rest_client().list_checkpoints(job_id).result().checkpoints
        assert [(c.checkpoint_type, c.tinker_path) for c in checkpoints] == [("sampler", named)]
    stranger_key = other_tenant_key(mesh)
    with (
        service_client(gateway, stranger_key) as stranger,
        pytest.raises(tinker.NotFoundError, match="no saved session state"),
    ):
        stranger.create_sampling_client(model_path=named).result()


def other_tenant_key(mesh) -> str:
    admin_key = (mesh.secrets_dir / ADMIN_KEY_FILE).read_text().strip()
    with AdminClient(mesh.scheduler_address, api_key=admin_key) as admin:
        admin.create_tenant("snapshots-other")
        admin.create_user("snapshots-bob", tenant_id="snapshots-other")
        return admin.create_api_key("snapshots-bob")


def test_lora_switches_seed_and_user_metadata_reach_the_run(mesh, gateway) -> None:
    run = tinker.RestClient(base_url=gateway, api_key=f"tml-{mesh.api_key}")
    with service_client(gateway, mesh.api_key) as service:  # closed: frees its device
        narrow = service.create_lora_training_client(
            base_model=BASE,
            rank=2,
            seed=7,
            train_mlp=False,
            train_unembed=False,
            user_metadata={"owner": "snapshots", "try": "1"},
        ).result()
        job_id = job_of(narrow.save_weights_for_sampler("spec").result().path)
    spec = job_spec(mesh, job_id)
    assert tuple(spec.model.lora.target_modules) == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert (spec.model.lora.rank, spec.session.seed) == (2, 7)
    metadata = run.get_training_run(job_id).result().user_metadata
    assert metadata is not None and metadata["owner"] == "snapshots" and metadata["try"] == "1"
    # The SDK's defaults train attention and MLP, as in Tinker; the unembedding only where
    # the gateway serves it (unembed_lora), and the run says so.
    with service_client(gateway, mesh.api_key) as service:
        wide = service.create_lora_training_client(base_model=BASE, rank=2).result()
        wide_job = job_of(wide.save_weights_for_sampler("spec").result().path)
        wide.forward_backward([sft_datum(SCORED)], "cross_entropy").result()
        wide.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    wide_modules = set(job_spec(mesh, wide_job).model.lora.target_modules)
    assert {"q_proj", "gate_proj", "up_proj", "down_proj"} <= wide_modules
    assert "lm_head" not in wide_modules
    said = run.get_training_run(wide_job).result().user_metadata or {}
    assert "not trained" in said["opentinker.train_unembed"]


def job_of(path: str) -> str:
    return path.removeprefix("tinker://").split("/")[0]


def job_spec(mesh, job_id: str):
    conn = Connection(mesh.scheduler_address, api_key=mesh.api_key, timeout=30.0)
    try:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(conn.channel)
        return conn.call(stub.GetJob, scheduler_pb2.GetJobRequest(job_id=job_id), None).job.spec
    finally:
        conn.close()
