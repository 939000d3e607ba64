"""The official ``tinker`` SDK, unchanged, against the gateway in front of a real mesh
(Redis, scheduler, envhub, worker; each training client is a trainer session job)."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import safetensors.torch
import tinker
from tinker import types
from tinker_gateway_helpers import (
    BASE,
    QWEN,
    gateway,
    mesh,
    monkeypatch_module,
    service,
    service_client,
    sft_datum,
)
from transformers import AutoTokenizer

import opentinker
from opentinker.services.gateway.in_thread import running_gateway
from opentinker.services.gateway.settings import GatewaySettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["gateway", "mesh", "monkeypatch_module", "service"]  # fixtures used here


def test_train_sample_and_continue_from_a_saved_state(service, mesh, gateway, tmp_path) -> None:
    caps = service.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [BASE, QWEN]
    assert caps.supported_models[0].max_context_length > 0  # from the local config.json
    trainer = service.create_lora_training_client(base_model=BASE, rank=4).result()
    assert trainer.get_info().lora_rank == 4

    # cross_entropy: the loss of one fixed sequence falls as we step on it.
    data = [sft_datum([5, 9, 13, 17, 21, 25, 29]), sft_datum([6, 10, 14, 18, 22])]
    adam = types.AdamParams(learning_rate=1e-1)
    losses = []
    for _ in range(5):
        fwd = trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(adam).result()
        losses.append(fwd.result().metrics["loss:sum"])
    assert losses[-1] < 0.7 * losses[0], losses
    # One datum's output: the logprob of each of its targets.
    out = trainer.forward(data, "cross_entropy").result()
    assert len(out.loss_fn_outputs) == 2 and out.loss_fn_outputs[0]["logprobs"].shape == [6]

    # Sampling from the trained weights, with the sampler's logprobs.
    sampler_name = "trained"
    sampler_path = trainer.save_weights_for_sampler(sampler_name).result().path
    assert sampler_path.endswith(f"/sampler_weights/{sampler_name}")
    sampler = trainer.save_weights_and_get_sampling_client().result()
    assert sampler.get_base_model() == BASE
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)
    result = sampler.sample(types.ModelInput.from_ints([5, 9, 13]), 2, params).result()
    assert len(result.sequences) == 2
    for seq in result.sequences:
        assert 1 <= len(seq.tokens) <= 5 and len(seq.logprobs) == len(seq.tokens)
        assert all(lp <= 0 and math.isfinite(lp) for lp in seq.logprobs)
    # Prompt logprobs under the sampler's weights: those the trainer has now.
    scored = [5, 9, 13, 17, 21]
    prompt_lp = sampler.compute_logprobs(types.ModelInput.from_ints(scored)).result()
    trainer_lp = trainer.forward([sft_datum(scored)], "cross_entropy").result()
    assert prompt_lp[0] is None and len(prompt_lp) == 5
    expected = trainer_lp.loss_fn_outputs[0]["logprobs"].tolist()
    assert prompt_lp[1:] == pytest.approx(expected, abs=2e-3)

    # importance_sampling with those samples: a finite loss, and a step after it.
    seq = result.sequences[0]
    tokens = [5, 9, 13, *seq.tokens]
    n = len(tokens) - 1
    is_datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "logprobs": np.array([0.0, 0.0, *seq.logprobs], dtype=np.float32)[:n],
            "advantages": np.array([0.0, 0.0, *[1.0] * len(seq.tokens)], dtype=np.float32)[:n],
        },
    )
    is_out = trainer.forward_backward([is_datum], "importance_sampling").result()
    assert math.isfinite(is_out.metrics["loss:sum"])
    trainer.optim_step(adam).result()

    # An unsupported loss fails its own future; the client goes on.
    with pytest.raises(tinker.RequestFailedError, match="'custom' is not supported"):
        trainer.forward_backward(data, "custom").result()
    before = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]

    # save_state, then a new client from it continues from the same weights.
    path = trainer.save_state("after-steps").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/after-steps")
    resumed = service.create_training_client_from_state(path).result()
    again = resumed.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert again == pytest.approx(before, rel=1e-4)
    resumed.forward_backward(data, "cross_entropy").result()
    resumed.optim_step(adam).result()

    # Training runs (the two session jobs) and their checkpoints; deleting one.
    rest = service.create_rest_client()
    run_id = path.removeprefix("tinker://").split("/")[0]
    listed = rest.list_training_runs().result()
    assert run_id in {r.training_run_id for r in listed.training_runs}
    assert listed.cursor.total_count == 2
    run = rest.get_training_run(run_id).result()
    assert (run.base_model, run.lora_rank) == (BASE, 4)
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == path
    checkpoints = rest.list_checkpoints(run_id).result().checkpoints
    assert {(c.checkpoint_type, c.checkpoint_id) for c in checkpoints} == {
        ("training", "weights/after-steps"),
        ("sampler", f"sampler_weights/{sampler_name}"),
    }
    assert all(c.size_bytes for c in checkpoints if c.checkpoint_type == "training")

    # Download: external weights, then one signed URL (no key needed) per file.
    export = trainer.save_weights_external("export", ttl_seconds=3600).result().path
    assert export == f"tinker://{run_id}/external_weights/export"
    [listed_export] = [
        c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == export
    ]
    assert listed_export.checkpoint_type == "external" and listed_export.expires_at is not None
    rest.set_checkpoint_ttl_from_tinker_path(export, None).result()  # kept after all
    urls = rest.get_external_weights_urls(export).result().urls
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(urls)
    assert "optimizer.pt" not in urls
    adapter = httpx.get(urls["adapter_model.safetensors"]).content
    assert set(safetensors.torch.load(adapter)) and len(adapter) > 1000
    forged = urls["adapter_config.json"][:-4] + "0000"
    assert httpx.get(forged).status_code == 403
    rest.delete_checkpoint_from_tinker_path(export).result()

    rest.delete_checkpoint_from_tinker_path(path).result()
    assert [c.checkpoint_type for c in rest.list_checkpoints(run_id).result().checkpoints] == [
        "sampler"
    ]
    with pytest.raises(tinker.NotFoundError, match="no saved session state"):
        service.create_training_client_from_state(path).result()
    keep = trainer.save_state("to-download").result().path

    # Closing the service client ends both session jobs, successfully.
    service.close("success").result()
    with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client:
        jobs = [j for j in client.list_jobs() if j.name == "tinker"]
    assert len(jobs) == 2 and all(j.state == "SUCCEEDED" for j in jobs), jobs

    # The SDK's own CLI downloads a training checkpoint (via a temporary external export).
    env = {**os.environ, "TINKER_BASE_URL": gateway, "TINKER_API_KEY": f"tml-{mesh.api_key}"}
    out = tmp_path / "downloaded"
    cli = [sys.executable, "-m", "tinker.cli", "checkpoint", "download", keep, "-o", str(out)]
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(out.rglob("adapter_model.safetensors")), list(out.rglob("*"))


def test_a_bad_key_is_refused_with_the_sdks_authentication_error(gateway) -> None:
    refused = pytest.raises(tinker.AuthenticationError, match="X-API-Key|credential|key")
    with service_client(gateway, "otk_not_a_key") as service, refused:  # the client is lazy
        service.create_lora_training_client(base_model=BASE, rank=4)


def test_a_base_model_samples_and_a_silent_session_expires(mesh, letter_model_dir) -> None:
    settings = GatewaySettings(
        scheduler_address=mesh.scheduler_address,
        port=0,
        base_models={BASE: str(letter_model_dir)},
        long_poll_s=2.0,
        session_expiry_s=4.0,  # the SDK beats every 10 s: its session expires between beats
    )
    with running_gateway(settings) as url, service_client(url, mesh.api_key) as service:
        sampler = service.create_sampling_client(base_model=BASE)  # no saved weights
        params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
        result = sampler.sample(types.ModelInput.from_ints([5, 9, 13]), 2, params).result()
        assert [len(s.tokens) == len(s.logprobs) >= 1 for s in result.sequences] == [True] * 2

        # Silent past session_expiry_s: the gateway closes the sampler's session job.
        with opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key) as client:
            [job] = [j for j in client.list_jobs() if j.name == "tinker-base-sampler"]
            deadline = time.monotonic() + 30
            while not client.get_job(job.job_id).done and time.monotonic() < deadline:
                time.sleep(0.5)
            assert client.get_job(job.job_id).state == "SUCCEEDED"
        # ... and answers a late heartbeat 410 Gone (which stops the SDK's heartbeat loop).
        headers = {"X-API-Key": f"tml-{mesh.api_key}"}
        session = httpx.post(f"{url}/api/v1/create_session", json={}, headers=headers).json()
        time.sleep(6)
        beat = {"session_id": session["session_id"]}
        late = httpx.post(f"{url}/api/v1/session_heartbeat", json=beat, headers=headers)
        assert late.status_code == 410, late.text


def test_a_download_url_outlives_a_gateway_restart(mesh, letter_model_dir) -> None:
    with socket.socket() as probe:  # one port for both runs, as a restarted service keeps it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = GatewaySettings(
        scheduler_address=mesh.scheduler_address,
        port=port,
        base_models={BASE: str(letter_model_dir)},
        long_poll_s=2.0,
        checkpoint_root=mesh.checkpoint_root,
    )
    with running_gateway(settings) as url, service_client(url, mesh.api_key) as service:
        trainer = service.create_lora_training_client(base_model=BASE, rank=4).result()
        export = trainer.save_weights_external("before-restart").result().path
        urls = service.create_rest_client().get_external_weights_urls(export).result().urls
        before = httpx.get(urls["adapter_config.json"])
        assert before.status_code == 200, before.text
    secret = mesh.checkpoint_root / ".gateway-download-secret"
    assert secret.stat().st_mode & 0o777 == 0o600  # made once, readable by its owner only

    env = {
        **os.environ,
        "OPENTINKER_GATEWAY_PORT": str(port),
        "OPENTINKER_GATEWAY_SCHEDULER_ADDRESS": mesh.scheduler_address,
        "OPENTINKER_GATEWAY_CHECKPOINT_ROOT": str(mesh.checkpoint_root),
    }
    restarted = subprocess.Popen([sys.executable, "-m", "opentinker.services.gateway"], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz").status_code == 200:
                    break
            time.sleep(0.2)
        after = httpx.get(urls["adapter_config.json"])  # the URL the first process signed
        assert after.status_code == 200, after.text
        assert after.content == before.content
    finally:
        restarted.terminate()
        restarted.wait(timeout=30)


def test_a_stop_string_ends_a_sample_with_the_token_that_completes_it(
    gateway, mesh, letter_model_dir
) -> None:
    with service_client(gateway, mesh.api_key) as service:
        trainer = service.create_lora_training_client(base_model=BASE, rank=4).result()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints([5, 9, 13])
        free = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=3)).result()
        tokens = free.sequences[0].tokens
        assert len(tokens) >= 4, tokens
        decode = AutoTokenizer.from_pretrained(letter_model_dir).decode
        stop = decode(tokens[1:3])[-2:]  # text that ends within the third token (or earlier)
        end = next(k for k in range(1, len(tokens) + 1) if stop in decode(tokens[:k]))

        params = types.SamplingParams(max_tokens=12, seed=3, stop=[stop])
        [cut] = sampler.sample(prompt, 1, params).result().sequences
        # the same draw (same seed), ended by the token that completes the stop string, kept
        assert cut.tokens == tokens[:end] and end <= 3
        assert cut.stop_reason == "stop" and len(cut.logprobs) == end
        assert cut.logprobs == pytest.approx(free.sequences[0].logprobs[:end])


def test_prompt_logprobs_last_n_past_the_prompt_is_refused_naming_it(gateway, mesh) -> None:
    """Tinker's server takes prompt_logprobs_last_n from 1 to len(prompt) - 1 and refuses
    others. One past the prompt was cut from the end instead: 2 logprobs for a 3-token prompt,
    each misaligned with the token it scores, and no error."""
    with service_client(gateway, mesh.api_key) as service:
        trainer = service.create_lora_training_client(base_model=BASE, rank=4).result()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints([5, 9, 13])
        params = types.SamplingParams(max_tokens=2, seed=3)
        scored = sampler.sample(
            prompt, 1, params, include_prompt_logprobs=True, prompt_logprobs_last_n=2
        ).result()
        assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == 3
        assert scored.prompt_logprobs[0] is None and None not in scored.prompt_logprobs[1:]
        with pytest.raises(tinker.BadRequestError, match="prompt_logprobs_last_n: 5"):
            sampler.sample(
                prompt, 1, params, include_prompt_logprobs=True, prompt_logprobs_last_n=5
            ).result()


def test_a_top_k_the_engine_cannot_apply_is_refused_naming_it(gateway, mesh) -> None:
    """The engine samples with temperature and top_p only. A top_k was dropped without a word,
    so a user asking for top_k=5 got draws from the whole vocabulary."""
    with service_client(gateway, mesh.api_key) as service:
        trainer = service.create_lora_training_client(base_model=BASE, rank=4).result()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints([5, 9, 13])
        unlimited = types.SamplingParams(max_tokens=2, seed=3, top_k=-1)  # the SDK's default
        assert len(sampler.sample(prompt, 1, unlimited).result().sequences) == 1
        with pytest.raises(tinker.BadRequestError, match="sampling_params.top_k: 5"):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, top_k=5)).result()


def test_an_optim_step_refused_for_its_params_leaves_the_training_client_usable(
    mesh, letter_model_dir
) -> None:
    """The SDK numbers a training client's calls (seq_id) and the gateway runs them in that
    order. An optim_step refused for its params (here an optimizer the trainer lacks) was
    answered 400 before its turn was taken, so its seq never passed: every later call of the
    client waited order_wait_s for it and failed. A load_state of a path that is not a saved
    state likewise."""
    settings = GatewaySettings(
        scheduler_address=mesh.scheduler_address,
        port=0,
        base_models={BASE: str(letter_model_dir)},
        long_poll_s=2.0,
        order_wait_s=10.0,
    )
    with running_gateway(settings) as url, service_client(url, mesh.api_key) as service:
        trainer = service.create_lora_training_client(base_model=BASE, rank=4).result()
        with pytest.raises(tinker.TinkerError, match="optimizer_params"):
            trainer.optim_step(types.DimuonParams(learning_rate=1e-3)).result()
        with pytest.raises(tinker.TinkerError, match="is not a saved state"):  # a load likewise
            trainer.load_state(f"tinker://{trainer.model_id}/sampler_weights/x").result()
        out = trainer.forward_backward([sft_datum([5, 9, 13, 17])], "cross_entropy").result()
        assert len(out.loss_fn_outputs) == 1
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_seed_zero_reproduces_its_samples_as_any_other_seed(gateway, mesh) -> None:
    """Tinker's seed makes a sample reproducible, 0 included. The trainer reads seed 0 as "none
    given" (derived from the call), and the gateway passed a user's 0 as is: two samples with
    seed=0 differed."""
    with service_client(gateway, mesh.api_key) as service:
        trainer = service.create_lora_training_client(base_model=BASE, rank=4).result()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints([5, 9, 13])
        for seed in (0, 7):
            params = types.SamplingParams(max_tokens=8, seed=seed, temperature=1.0)
            draws = [sampler.sample(prompt, 2, params).result().sequences for _ in range(2)]
            assert [s.tokens for s in draws[0]] == [s.tokens for s in draws[1]], seed
