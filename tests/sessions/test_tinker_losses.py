"""The RL losses tinker-cookbook's recipes default to, through the real ``tinker`` SDK and the
gateway: ``stable_reinforce`` (sampling records named by provenance) and ``gspo`` (the
sequence ratio over ``sequence_ratio_mask``), and the clear user errors when their inputs are
missing or wrong."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
from tinker import types
from tinker_gateway_helpers import BASE, gateway, monkeypatch_module, service

from opentinker.services.launcher.mesh import LocalMesh, MeshSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["gateway", "mesh", "monkeypatch_module", "service"]  # fixtures used here

PROMPT = [5, 9, 13]
ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):  # noqa: ANN001, ANN201
    """A slot per test: each test's training client keeps its device until the module ends
    (the module's ServiceClient heartbeats its sessions), and a session's job holds a whole
    device, so with the 2 slots of a 2-core machine the third test waited 600 s."""
    with LocalMesh(MeshSettings(run_root=tmp_path_factory.mktemp("mesh"), cpu_slots=3)) as running:
        yield running


def rl_datum(seq: types.SampledSequence, advantage: float, *, provenance: bool) -> types.Datum:
    """The cookbook's layout: prompt + sampled[:-1] in, 0 on prompt targets then the sampled
    tokens out; the sampler's logprobs and the advantage on sampled positions."""
    ob = len(PROMPT) - 1
    n = ob + len(seq.tokens)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([*PROMPT, *seq.tokens[:-1]]),
        loss_fn_inputs={
            "target_tokens": np.array([0] * ob + list(seq.tokens), dtype=np.int64),
            "logprobs": np.array([0.0] * ob + list(seq.logprobs), dtype=np.float32),
            "advantages": np.array([0.0] * ob + [advantage] * len(seq.tokens), dtype=np.float32),
            "sequence_ratio_mask": np.array([0.0] * ob + [1.0] * len(seq.tokens), np.float32),
        },
    )
    assert datum.model_input.length == n
    if not provenance:
        return datum
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=ob),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens)),
        ],
    )


def sampled_logprob(trainer, datum: types.Datum) -> float:
    """The summed logprob of a datum's sampled targets under the trainer's weights now."""
    out = trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    return float(np.sum(out.to_numpy()[len(PROMPT) - 1 :]))


def test_stable_reinforce_trains_on_recorded_samples(service) -> None:
    trainer = service.create_lora_training_client(base_model=BASE, rank=4).result()
    sampler = trainer.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=11)
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
    seq = max(result.sequences, key=lambda s: len(s.tokens))
    assert len(seq.tokens) >= 2 and seq.sequence_id
    datum = rl_datum(seq, 1.0, provenance=True)
    before = sampled_logprob(trainer, datum)

    out = trainer.forward_backward([datum], "stable_reinforce", {"kl_coeff": 0.01}).result()
    # on-policy: ratio 1 everywhere, so the loss is -A * sum(logp) = -before (KL 0)
    assert out.metrics["loss:sum"] == pytest.approx(-before, abs=1e-2)
    assert out.metrics["kl:sum"] == pytest.approx(0.0, abs=1e-2)
    trainer.optim_step(ADAM).result()
    for _ in range(2):  # off-policy now: the recorded logprobs are the first weights'
        trainer.forward_backward([datum], "stable_reinforce", {"kl_coeff": 0.01}).result()
        trainer.optim_step(ADAM).result()
    assert sampled_logprob(trainer, datum) > before  # a positive advantage made it likelier

    # A sequence nobody recorded (a sampler without record_stability_info): that future fails
    # with a user error naming the fix, and the client goes on.
    plain = trainer.save_weights_and_get_sampling_client().result()
    other = plain.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0]
    if len(other.tokens) >= 2:
        with pytest.raises(tinker.RequestFailedError, match="record_stability_info"):
            bad = rl_datum(other, 1.0, provenance=True)
            trainer.forward_backward([bad], "stable_reinforce").result()
    with pytest.raises(tinker.RequestFailedError, match="provenance"):
        trainer.forward_backward(
            [rl_datum(seq, 1.0, provenance=False)], "stable_reinforce"
        ).result()
    # A target that is not the recorded token is refused.
    forged = rl_datum(seq, 1.0, provenance=True)
    targets = forged.loss_fn_inputs["target_tokens"].to_numpy().copy()
    targets[-1] = (targets[-1] + 1) % 30
    forged = types.Datum(
        model_input=forged.model_input,
        loss_fn_inputs={**forged.loss_fn_inputs, "target_tokens": targets},
        model_input_spans=forged.model_input_spans,
        loss_fn_input_spans=forged.loss_fn_input_spans,
    )
    with pytest.raises(tinker.RequestFailedError, match="differ from the tokens sampled"):
        trainer.forward_backward([forged], "stable_reinforce").result()
    assert math.isfinite(trainer.forward([datum], "cross_entropy").result().metrics["loss:sum"])


def test_gspo_steps_with_the_sequence_ratio_and_needs_its_mask(service) -> None:
    trainer = service.create_lora_training_client(base_model=BASE, rank=4).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=5)
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
    seq = max(result.sequences, key=lambda s: len(s.tokens))
    datum = rl_datum(seq, 1.0, provenance=False)
    before = sampled_logprob(trainer, datum)
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    out = trainer.forward_backward([datum], "gspo", config).result()
    # on-policy: every ratio is 1, nothing clipped, loss = -A * (number of sampled tokens)
    assert out.metrics["loss:sum"] == pytest.approx(-len(seq.tokens), abs=1e-2)
    assert out.metrics["clip_fraction:mean"] == 0.0
    trainer.optim_step(ADAM).result()
    for _ in range(2):
        trainer.forward_backward([datum], "gspo", config).result()
        trainer.optim_step(ADAM).result()
    assert sampled_logprob(trainer, datum) > before

    no_mask = types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={
            k: v for k, v in datum.loss_fn_inputs.items() if k != "sequence_ratio_mask"
        },
    )
    with pytest.raises(tinker.RequestFailedError, match="sequence_ratio_mask"):
        trainer.forward_backward([no_mask], "gspo").result()
    with pytest.raises(tinker.RequestFailedError, match="kl_coeff"):
        trainer.forward_backward([datum], "gspo", {"kl_coeff": 0.1}).result()


def test_dro_is_tinkers_definition_and_trains(service) -> None:
    trainer = service.create_lora_training_client(base_model=BASE, rank=4).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
    seq = max(result.sequences, key=lambda s: len(s.tokens))
    datum = rl_datum(seq, 1.0, provenance=False)
    out = trainer.forward([datum], "cross_entropy").result()
    logp = out.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64)
    q = datum.loss_fn_inputs["logprobs"].to_numpy().astype(np.float64)
    adv = datum.loss_fn_inputs["advantages"].to_numpy().astype(np.float64)
    beta = 0.5
    # Tinker's docs: loss = -sum(target_logprobs * A - beta/2 * (target_logprobs - q)^2),
    # over every position (the prompt's too: A = 0 and q = 0 there).
    expected = -np.sum(logp * adv - 0.5 * beta * (logp - q) ** 2)
    before = sampled_logprob(trainer, datum)
    got = trainer.forward_backward([datum], "dro", {"beta": beta}).result()
    assert got.metrics["loss:sum"] == pytest.approx(expected, rel=1e-3, abs=1e-2)
    trainer.optim_step(ADAM).result()
    for _ in range(2):
        trainer.forward_backward([datum], "dro", {"beta": beta}).result()
        trainer.optim_step(ADAM).result()
    assert sampled_logprob(trainer, datum) > before  # a positive advantage made it likelier
    with pytest.raises(tinker.RequestFailedError, match="clip_low_threshold"):
        trainer.forward_backward([datum], "dro", {"clip_low_threshold": 0.8}).result()
