"""The vLLM engine's CPU-testable parts: the engine choice, vLLM's options, turning vLLM's
output objects into Completions, and the LoRA adapter folders vLLM loads (read back by peft).

vLLM itself needs a GPU: tests/rollout/test_vllm_engine_gpu.py runs it there. The fakes below stand
for vLLM's *output objects* only (``vllm.outputs.RequestOutput``/``CompletionOutput``/
``Logprob``, built from their documented fields): data outside our system.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from opentinker.errors import ConfigError
from opentinker.services.modeling.tiny_model import QWEN2_5_0_5B_SHAPE, build_tiny_model
from opentinker.services.rollout.engines.engine import TransformersEngine, WeightUpdateError
from opentinker.services.rollout.engines.engine_choice import choose_engine, engine_factory
from opentinker.services.rollout.engines.vllm_adapters import (
    AdapterVersions,
    WeightShapes,
    max_lora_rank_for,
    peft_key,
)
from opentinker.services.rollout.engines.vllm_engine import sampling_options, vllm_options
from opentinker.services.rollout.engines.vllm_outputs import (
    VllmOutputError,
    completions_from_outputs,
    prompt_logprobs_from_output,
)
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.services.rollout.types import Completion
from opentinker.spec import LoraConfig, ModelSpec, SamplingParams

pytestmark = pytest.mark.integration

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
EOS = 2


# --- fakes of vLLM's output objects (their documented fields only) ---------------------------
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True


def sample_output(ids: list[int], logprobs: list[float], finish: str) -> RequestOutput:
    # vLLM's dict per token holds the sampled token and, when it is not the top one, the top-k
    # asked for (logprobs=0 asks for none); an extra entry checks the right key is read.
    entries = [
        {t: Logprob(lp, rank=2), 99: Logprob(-0.01, rank=1)}
        for t, lp in zip(ids, logprobs, strict=True)
    ]
    out = CompletionOutput(0, "", ids, sum(logprobs), entries, finish, EOS if finish else None)
    return RequestOutput("r", [5, 6], None, [out])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


# --- the engine choice ---------------------------------------------------------------------
def test_auto_picks_transformers_on_cpu_and_vllm_on_cuda_when_installed() -> None:
    assert choose_engine("auto", device="cpu", cuda_available=False, vllm_importable=True) == (
        "transformers",
        "auto: no CUDA device",
    )
    name, why = choose_engine("auto", device="cuda:0", cuda_available=True, vllm_importable=False)
    assert (name, why) == ("transformers", "auto: CUDA, but vllm is not installed")
    name, _ = choose_engine("auto", device="", cuda_available=True, vllm_importable=True)
    assert name == "vllm"
    name, _ = choose_engine(
        "transformers", device="cuda:0", cuda_available=True, vllm_importable=True
    )
    assert name == "transformers"


def test_vllm_asked_for_where_it_cannot_run_is_a_config_error_naming_why() -> None:
    with pytest.raises(ConfigError, match="needs CUDA devices.*'cpu'") as on_cpu:
        choose_engine("vllm", device="cpu", cuda_available=False, vllm_importable=True)
    assert on_cpu.value.reason == "VLLM_NEEDS_CUDA"
    with pytest.raises(ConfigError, match="not installed") as missing:
        choose_engine("vllm", device="cuda:0", cuda_available=True, vllm_importable=False)
    assert missing.value.reason == "VLLM_NOT_INSTALLED"


def test_engine_setting_comes_from_the_environment_and_is_validated(monkeypatch) -> None:
    monkeypatch.setenv("OPENTINKER_ROLLOUT_ENGINE", "vllm")
    monkeypatch.setenv("OPENTINKER_ROLLOUT_GPU_MEMORY_UTILIZATION", "0.5")
    settings = RolloutSettings()
    assert (settings.engine, settings.gpu_memory_utilization) == ("vllm", 0.5)
    monkeypatch.setenv("OPENTINKER_ROLLOUT_ENGINE", "sglang")
    with pytest.raises(ValueError, match="engine"):
        RolloutSettings()


def test_the_cpu_rollout_loads_transformers_without_importing_vllm(model_dir: Path) -> None:
    settings = RolloutSettings(device="cpu", engine="auto")
    name, factory = engine_factory(settings, cuda_available=False, vllm_importable=True)
    engine = factory(ModelSpec(base_model=str(model_dir), finetune="full"))
    assert name == "transformers" and isinstance(engine, TransformersEngine)
    assert "vllm" not in sys.modules
    with pytest.raises(ConfigError, match="needs CUDA"):
        engine_factory(
            settings.model_copy(update={"engine": "vllm"}),
            cuda_available=False,
            vllm_importable=True,
        )


# --- vLLM's options --------------------------------------------------------------------------
def test_vllm_options_follow_the_placement_rule_and_the_lora_config() -> None:
    settings = RolloutSettings(gpu_memory_utilization=0.4, tensor_parallel_size=2)
    lora = ModelSpec(base_model="m", finetune="lora", lora=LORA)
    options = vllm_options(lora, settings, "cuda:0")
    assert options["dtype"] == "bfloat16"  # the trainer's dtype on CUDA (placement.py)
    assert options["logprobs_mode"] == "processed_logprobs"
    assert (options["gpu_memory_utilization"], options["tensor_parallel_size"]) == (0.4, 2)
    assert options["enable_lora"] and options["max_lora_rank"] == 8  # rank 4 -> vLLM's slot 8
    full = vllm_options(ModelSpec(base_model="m", finetune="full"), settings, "cuda")
    assert "enable_lora" not in full
    with pytest.raises(ConfigError, match="runs on CUDA"):
        vllm_options(lora, settings, "cpu")
    with pytest.raises(ConfigError, match="cuda:1"):
        vllm_options(lora, settings, "cuda:1")
    assert [max_lora_rank_for(r) for r in (1, 2, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]
    with pytest.raises(WeightUpdateError, match="above"):
        max_lora_rank_for(1024)


def test_requests_carry_a_seed_only_when_the_settings_ask(monkeypatch) -> None:
    # vLLM draws seeded rows one at a time: by default they share the engine's generator
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5)
    unseeded = sampling_options(sampling, None, greedy=False, eos=2)
    assert "seed" not in unseeded
    assert (unseeded["temperature"], unseeded["top_p"], unseeded["max_tokens"]) == (0.7, 0.9, 5)
    assert sampling_options(sampling, 7, greedy=False, eos=2) == unseeded | {"seed": 7}
    assert RolloutSettings().vllm_seed_per_request is False
    monkeypatch.setenv("OPENTINKER_ROLLOUT_VLLM_SEED_PER_REQUEST", "true")
    assert RolloutSettings().vllm_seed_per_request is True


# --- vLLM outputs -> Completions ---------------------------------------------------------------
def test_outputs_become_completions_with_the_sampled_tokens_logprobs() -> None:
    stopped = sample_output([7, 8, EOS], [-0.5, -1.25, -0.1], "stop")
    cut = sample_output([7, 7], [-2.0, -3.0], "length")
    assert completions_from_outputs([stopped, cut], eos_token_id=EOS) == [
        Completion(token_ids=[7, 8, EOS], logprobs=[-0.5, -1.25, -0.1]),
        Completion(token_ids=[7, 7], logprobs=[-2.0, -3.0]),
    ]


def test_malformed_outputs_fail_naming_the_field() -> None:
    no_logprobs = sample_output([7], [-1.0], "length")
    no_logprobs.outputs[0].logprobs = None
    with pytest.raises(VllmOutputError, match="logprobs=0"):
        completions_from_outputs([no_logprobs], eos_token_id=EOS)
    short = sample_output([7, 8], [-1.0, -1.0], "length")
    short.outputs[0].logprobs = short.outputs[0].logprobs[:1]
    with pytest.raises(VllmOutputError, match="1 entries for 2 token_ids"):
        completions_from_outputs([short], eos_token_id=EOS)
    wrong_key = sample_output([7], [-1.0], "length")
    wrong_key.outputs[0].logprobs = [{8: Logprob(-1.0)}]
    with pytest.raises(VllmOutputError, match=r"logprobs\[0\] holds no logprob for token 7"):
        completions_from_outputs([wrong_key], eos_token_id=EOS)
    other_stop = sample_output([7, 9], [-1.0, -1.0], "stop")
    with pytest.raises(VllmOutputError, match="not eos 2"):
        completions_from_outputs([other_stop], eos_token_id=EOS)
    two = sample_output([7], [-1.0], "length")
    two.outputs.append(two.outputs[0])
    with pytest.raises(VllmOutputError, match="2 outputs"):
        completions_from_outputs([two], eos_token_id=EOS)
    # Not finite: the trainer's ratio exp(new - old) would be inf (-inf passed before)
    for bad in (float("-inf"), float("nan")):
        unusable = sample_output([7, 8], [-1.0, bad], "length")
        with pytest.raises(VllmOutputError, match=r"logprobs\[1\]: the logprob of token 8 is"):
            completions_from_outputs([unusable], eos_token_id=EOS)


def test_prompt_logprobs_skip_the_first_token_and_read_each_prompt_token() -> None:
    ids = [5, 6, 7]
    entries = [None, {6: Logprob(-0.25), 1: Logprob(-0.1)}, {7: Logprob(-4.0)}]
    request = RequestOutput("r", ids, entries, [CompletionOutput(0, "", [1], None, None)])
    assert prompt_logprobs_from_output(request, ids) == [-0.25, -4.0]
    request.prompt_logprobs = None
    with pytest.raises(VllmOutputError, match="prompt_logprobs=0"):
        prompt_logprobs_from_output(request, ids)
    request.prompt_logprobs = entries[:2]
    with pytest.raises(VllmOutputError, match="2 entries for a 3-token prompt"):
        prompt_logprobs_from_output(request, ids)


# --- LoRA adapter folders and update checks ------------------------------------------------------
def test_update_shapes_are_the_trainers_names(model_dir: Path) -> None:
    lora = ModelSpec(base_model=str(model_dir), finetune="lora", lora=LORA)
    engine = TransformersEngine.load(lora, device="cpu")  # wrapped as the trainer wraps it
    served = {n: tuple(p.shape) for n, p in engine.model.named_parameters() if p.requires_grad}
    assert WeightShapes.of(lora).shapes == served
    full = ModelSpec(base_model=str(model_dir), finetune="full")
    plain = TransformersEngine.load(full, device="cpu")
    shapes = WeightShapes.of(full)
    assert shapes.shapes == {n: tuple(p.shape) for n, p in plain.model.named_parameters()}
    with pytest.raises(WeightUpdateError, match="'model.nope'"):
        shapes.check({"model.nope": torch.zeros(1)})
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(WeightUpdateError, match=r"shape \(3,\)"):
        shapes.check({name: torch.zeros(3)})


def test_adapter_folders_load_back_in_peft_and_compute_what_the_engine_serves(
    model_dir: Path, tmp_path: Path
) -> None:
    spec = ModelSpec(base_model=str(model_dir), finetune="lora", lora=LORA)
    shapes = WeightShapes.of(spec)
    versions = AdapterVersions(spec, shapes, tmp_path / "adapters")
    assert not versions.changed and all(not t.any() for t in versions.state.values())
    generator = torch.Generator().manual_seed(0)
    update = {n: torch.randn(s, generator=generator) * 0.2 for n, s in shapes.shapes.items()}
    first = dict(list(update.items())[: len(update) // 2])
    versions.update(first)  # an update in two parts
    versions.update({n: t for n, t in update.items() if n not in first})
    folder = versions.write(3)
    assert folder == tmp_path / "adapters" / "v3" and not versions.changed

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(folder))
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(got) == set(update)
    assert all(torch.equal(got[n], update[n]) for n in update)
    assert peft_key("a.q_proj.lora_A.default.weight") == "a.q_proj.lora_A.weight"

    engine = TransformersEngine.load(spec, device="cpu")
    engine.apply_weights(update, policy_version=3)
    ids = engine.tokenizer("the answer is a letter")["input_ids"]
    loaded.eval()
    with torch.no_grad():
        logits = loaded(input_ids=torch.tensor([ids])).logits[0, :-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    # Same adapter, same scaling (alpha / r) read from the saved config.
    assert engine.logprobs_of(ids) == pytest.approx(expected.tolist(), abs=1e-5)

    versions.drop(3)
    assert not folder.exists()


def test_an_init_adapter_is_the_first_version(model_dir: Path, tmp_path: Path) -> None:
    spec = ModelSpec(base_model=str(model_dir), finetune="lora", lora=LORA)
    shapes = WeightShapes.of(spec)
    first = AdapterVersions(spec, shapes, tmp_path / "a")
    first.update({n: torch.full(s, 0.5) for n, s in shapes.shapes.items()})
    saved = first.write(7)
    started = AdapterVersions(
        spec.model_copy(update={"init_adapter": str(saved)}), shapes, tmp_path / "b"
    )
    assert started.changed  # the engine serves it as version 0
    assert all(torch.equal(t, torch.full_like(t, 0.5)) for t in started.state.values())


def test_the_0_5b_shape_has_qwen2_5_0_5b_parameter_count() -> None:
    shape = QWEN2_5_0_5B_SHAPE
    config = Qwen2Config(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    assert 490e6 < params < 500e6  # Qwen2.5-0.5B: 494M


def test_the_worker_extension_resolves_by_the_name_vllm_is_given() -> None:
    import importlib

    from opentinker.services.rollout.engines.vllm_engine import WORKER_EXTENSION

    module, _, name = WORKER_EXTENSION.rpartition(".")
    extension = getattr(importlib.import_module(module), name)  # as vLLM resolves it
    assert callable(extension.opentinker_load_weights)  # the method collective_rpc names
    assert "vllm" not in sys.modules


def test_an_embedding_adapter_folder_loads_back_in_peft(model_dir: Path, tmp_path: Path) -> None:
    """LoRA on embed_tokens (vLLM takes it for e.g. Llama and Qwen3, not Qwen2): PEFT names
    those parameters ``...lora_embedding_A.default`` with no ``.weight`` after, and saves them
    as ``...lora_embedding_A``: the folder holds that key (PEFT reads ``.default`` back too, but
    vLLM refuses it: tests/rollout/test_vllm_api.py), and it reads back as what was sent."""
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("embed_tokens", "q_proj"))
    spec = ModelSpec(base_model=str(model_dir), finetune="lora", lora=lora)
    shapes = WeightShapes.of(spec)
    assert any(n.endswith("lora_embedding_A.default") for n in shapes.shapes)
    versions = AdapterVersions(spec, shapes, tmp_path / "adapters")
    generator = torch.Generator().manual_seed(1)
    update = {n: torch.randn(s, generator=generator) * 0.2 for n, s in shapes.shapes.items()}
    versions.update(update)
    folder = versions.write(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(folder))
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(got) == set(update)
    assert all(torch.equal(got[n], update[n]) for n in update), "every tensor read back"
    assert peft_key("m.embed_tokens.lora_embedding_B.default") == "m.embed_tokens.lora_embedding_B"
