"""SharedLoraEngine on the tiny local model: one mixed-adapter call equals each adapter alone,
each adapter's weights are the trainer's, updates stay in their adapter, and the batcher
merges concurrent jobs' calls into one engine call."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.engines.engine import WeightUpdateError
from opentinker.services.rollout.engines.multi_lora import LoraRow, SharedLoraEngine
from opentinker.services.rollout.shared.batcher import MixedBatcher
from opentinker.services.rollout.shared.shared_engine import SharedAdapters
from opentinker.spec import LoraConfig, ModelSpec, SamplingParams

pytestmark = pytest.mark.integration

SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


def spec_of(model_dir: Path, rank: int = 4) -> ModelSpec:
    return ModelSpec(base_model=str(model_dir), finetune="lora", lora=LoraConfig(rank=rank))


def trainer_model(model_dir: Path, spec: ModelSpec, seed: int) -> peft.PeftModel:
    """A trainer-side LoRA model (adapter "default") with non-zero, seed-made adapter weights."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = spec.lora
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        ),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model.eval()


def trainer_state(model: peft.PeftModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def manual_logprobs(model: peft.PeftModel, prompt: list[int], completion: list[int]) -> list[float]:
    """The trainer's logprobs of ``completion`` after ``prompt`` (temperature 1, no padding)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    positions = range(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return [logprobs[p, t].item() for p, t in zip(positions, completion, strict=True)]


@pytest.fixture(scope="module")
def two_jobs(model_dir: Path) -> tuple[SharedLoraEngine, dict[str, peft.PeftModel]]:
    """A shared engine with adapters "job_a" (rank 4) and "job_b" (rank 8), each holding its
    trainer's weights."""
    engine = SharedLoraEngine.load(str(model_dir), device="cpu")
    trainers = {}
    for adapter, rank, seed in (("job_a", 4, 1), ("job_b", 8, 2)):
        spec = spec_of(model_dir, rank)
        engine.add_adapter(adapter, spec)
        trainers[adapter] = trainer_model(model_dir, spec, seed)
        engine.apply_adapter_weights(adapter, trainer_state(trainers[adapter]))
    return engine, trainers


def prompts(engine: SharedLoraEngine) -> list[list[int]]:
    texts = ["hi", "what is the capital of France?", "name a letter", "one two three"]
    return [engine.tokenizer.encode(t) for t in texts]


def test_a_mixed_batch_equals_each_adapter_alone(two_jobs) -> None:  # noqa: ANN001
    engine, trainers = two_jobs
    ps = prompts(engine)
    mixed = [
        LoraRow(p, adapter, SAMPLING, seed=10 + i)
        for i, (p, adapter) in enumerate(zip(ps, ["job_a", "job_b", "job_a", "job_b"], strict=True))
    ]
    together = engine.generate_rows(mixed)
    for adapter in ("job_a", "job_b"):
        mine = [i for i, row in enumerate(mixed) if row.adapter == adapter]
        alone = engine.generate_rows([mixed[i] for i in mine])
        for i, solo in zip(mine, alone, strict=True):
            assert together[i].token_ids == solo.token_ids
            assert together[i].logprobs == pytest.approx(solo.logprobs, abs=1e-4)
            # and they are the job's trainer's logprobs: its adapter, not the base, not the other
            expected = manual_logprobs(trainers[adapter], mixed[i].prompt, solo.token_ids)
            assert together[i].logprobs == pytest.approx(expected, abs=1e-4)
    # the two adapters really differ: the same prompt and seed give different distributions
    assert engine.adapter_logprobs_of("job_a", ps[1]) != pytest.approx(
        engine.adapter_logprobs_of("job_b", ps[1]), abs=1e-3
    )


def test_rows_sample_by_their_own_seed_and_greedy_rows_take_the_argmax(two_jobs) -> None:  # noqa: ANN001
    engine, trainers = two_jobs
    p = prompts(engine)[1]
    same = engine.generate_rows([LoraRow(p, "job_a", SAMPLING, seed=5)] * 2)
    other = engine.generate_rows([LoraRow(p, "job_a", SAMPLING, seed=6)])
    # The same tokens; logprobs equal up to float32 rounding: two rows of one batch may be
    # summed in another order by the CPU's matmul kernels (1 ulp apart on some processors)
    assert same[0].token_ids == same[1].token_ids
    assert same[0].logprobs == pytest.approx(same[1].logprobs, abs=1e-5)
    assert same[0].token_ids != other[0].token_ids
    greedy = engine.generate_rows([LoraRow(p, "job_b", SAMPLING, seed=0, greedy=True)])[0]
    with torch.no_grad():  # the trainer's own argmax decoding
        ids = torch.tensor([p])
        out = trainers["job_b"].generate(
            input_ids=ids, do_sample=False, max_new_tokens=8, eos_token_id=engine.eos_token_id
        )
    assert greedy.token_ids == out[0, len(p) :].tolist()[: len(greedy.token_ids)]


def test_probe_and_updates_stay_in_their_adapter(model_dir: Path) -> None:
    engine = SharedLoraEngine.load(str(model_dir), device="cpu")
    spec = spec_of(model_dir)
    for adapter in ("job_a", "job_b"):
        engine.add_adapter(adapter, spec)
    probe = engine.tokenizer.encode("the probe sequence")
    b_before = engine.adapter_logprobs_of("job_b", probe)
    trainer = trainer_model(model_dir, spec, seed=3)
    engine.apply_adapter_weights("job_a", trainer_state(trainer))
    assert engine.adapter_logprobs_of("job_a", probe) == pytest.approx(
        manual_logprobs(trainer, probe[:1], probe[1:]), abs=1e-5
    )
    assert engine.adapter_logprobs_of("job_b", probe) == b_before  # bit for bit
    base_name = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    with pytest.raises(WeightUpdateError, match="not a tensor of this job's LoRA adapter"):
        engine.apply_adapter_weights("job_a", {base_name: torch.zeros(1)})
    other = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.job_b.weight"
    with pytest.raises(WeightUpdateError, match="not a tensor"):
        engine.apply_adapter_weights("job_a", {other: torch.zeros(4, 64)})
    with pytest.raises(ValueError, match="'job_c' is not loaded"):
        engine.generate_rows([LoraRow(probe, "job_c", SAMPLING, seed=0)])
    engine.remove_adapter("job_a")
    with pytest.raises(ValueError, match="'job_a' is not loaded"):
        engine.adapter_logprobs_of("job_a", probe)
    engine.add_adapter("job_c", spec)  # a later job takes the freed place
    assert engine.adapter_logprobs_of("job_b", probe) == b_before


def test_the_batcher_merges_concurrent_jobs_into_one_engine_call(model_dir: Path) -> None:
    engine = SharedLoraEngine.load(str(model_dir), device="cpu")
    shared = SharedAdapters(MixedBatcher(engine, window_s=0.5), capacity=2)
    spec = spec_of(model_dir)
    a, b = shared.attach("job-a", spec), shared.attach("job-b", spec)
    with pytest.raises(Exception, match="serves 2 adapters, all in use"):
        shared.attach("job-c", spec)
    ps = prompts(engine)
    results: dict[str, list] = {}

    def play(name: str, view) -> None:  # noqa: ANN001
        results[name] = view.generate(ps[:3], SAMPLING, seed=7)

    threads = [threading.Thread(target=play, args=item) for item in (("a", a), ("b", b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert shared.batcher.stats.calls_merged == [2]  # both jobs' calls in one engine call
    assert shared.batcher.stats.rows == [6]
    # each job got its own rows, the same as when it calls alone
    shared.batcher.window_s = 0.0
    assert [c.token_ids for c in a.generate(ps[:3], SAMPLING, seed=7)] == [
        c.token_ids for c in results["a"]
    ]
    shared.detach("job-a")
    assert shared.jobs == ["job-b"]
    shared.attach("job-c", spec)  # room again


def test_a_vision_language_base_is_refused_naming_why(tmp_path: Path) -> None:
    from opentinker.services.modeling.tiny_vl_model import ensure_tiny_vl_model

    vl_dir = ensure_tiny_vl_model(tmp_path / "tiny-vl")
    with pytest.raises(ValueError, match="is a vision-language model; a shared engine serves"):
        SharedLoraEngine.load(str(vl_dir), device="cpu")


def test_a_job_that_leaves_while_its_call_waits_fails_only_its_own_call(model_dir: Path) -> None:
    """Job a's stream ends (its trainer died) while its generate call waits in the batcher
    for company: its adapter is dropped, and job b's next call, which the batcher would merge
    with a's, still gets its own rows; only a's call fails, naming why. A later job a (a new
    attempt) is served again."""
    engine = SharedLoraEngine.load(str(model_dir), device="cpu")
    shared = SharedAdapters(MixedBatcher(engine, window_s=5.0), capacity=2)
    spec = spec_of(model_dir)
    a, b = shared.attach("job-a", spec), shared.attach("job-b", spec)
    ps = prompts(engine)
    outcome: dict[str, object] = {}

    def play_a() -> None:
        try:
            outcome["a"] = a.generate(ps[:2], SAMPLING, seed=7)
        except Exception as err:  # noqa: BLE001 - the test reads what a got
            outcome["a"] = err

    thread = threading.Thread(target=play_a)
    thread.start()
    deadline = time.monotonic() + 30
    while not shared.batcher._pending:  # a's call waits for b's to join it
        assert time.monotonic() < deadline, "a's call never reached the batcher"
        time.sleep(0.01)
    shared.detach("job-a")
    got = b.generate(ps[:3], SAMPLING, seed=7)  # before the fix: ValueError, a's rows with it
    thread.join(timeout=30)
    assert isinstance(outcome["a"], Exception), outcome["a"]
    assert "left this shared engine" in str(outcome["a"])
    shared.batcher.window_s = 0.0
    assert [c.token_ids for c in got] == [c.token_ids for c in b.generate(ps[:3], SAMPLING, seed=7)]
    again = shared.attach("job-a", spec)
    assert len(again.generate(ps[:1], SAMPLING, seed=7)) == 1
