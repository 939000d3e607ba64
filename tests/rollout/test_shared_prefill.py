"""Each distinct prompt of a generate batch computed once
(services/rollout/engines/shared_prefill.py):
the rows continue from a shared cache and sample exactly what the plain path samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker.services.modeling.tiny_model import build_tiny_model
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.engines.shared_prefill import prompt_inputs
from opentinker.spec import ModelSpec

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TransformersEngine:
    model_dir: Path = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
    return TransformersEngine.load(
        ModelSpec(base_model=str(model_dir), finetune="full"), device="cpu"
    )


def group_prompts(engine: TransformersEngine, samples: int) -> list[list[int]]:
    """Three prompts of different lengths, ``samples`` rows each, groups interleaved."""
    texts = ["hi", "a somewhat longer question here", "what is 2 + 2?"]
    prompts = [
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False
        )
        for t in texts
    ]
    assert len({len(p) for p in prompts}) == 3
    return [prompts[row % 3] for row in range(3 * samples)]


def sample(engine: TransformersEngine, inputs: dict, *, seed: int, greedy: bool):
    torch.manual_seed(seed)
    with torch.no_grad():
        return engine.model.generate(
            **inputs,
            do_sample=not greedy,
            top_k=0 if not greedy else None,
            max_new_tokens=6,
            eos_token_id=engine.eos_token_id,
            pad_token_id=engine.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )


def both_paths(engine: TransformersEngine, prompts: list[list[int]]) -> tuple[dict, dict]:
    """(shared, plain) inputs: a distinct tag per row turns the sharing off."""
    shared = prompt_inputs(engine.model, prompts, engine.pad_token_id, engine.device)
    plain = prompt_inputs(
        engine.model, prompts, engine.pad_token_id, engine.device, tags=range(len(prompts))
    )
    return shared, plain


@pytest.mark.parametrize("greedy", [True, False])
def test_rows_sharing_a_prompt_sample_what_the_plain_path_samples(
    engine: TransformersEngine, greedy: bool
) -> None:
    prompts = group_prompts(engine, samples=4)
    shared, plain = both_paths(engine, prompts)
    assert "past_key_values" in shared and "past_key_values" not in plain
    assert torch.equal(shared["input_ids"], plain["input_ids"])
    assert torch.equal(shared["attention_mask"], plain["attention_mask"])
    a = sample(engine, shared, seed=5, greedy=greedy)
    b = sample(engine, plain, seed=5, greedy=greedy)
    assert torch.equal(a.sequences, b.sequences)
    for step_a, step_b in zip(a.logits, b.logits, strict=True):
        torch.testing.assert_close(step_a, step_b, atol=1e-5, rtol=1e-5)
    if not greedy:  # the groups' samples differ: the rows are not one row repeated
        assert len({tuple(row) for row in a.sequences.tolist()}) > 3


def test_the_engine_gives_each_row_the_logprobs_of_its_own_tokens(
    engine: TransformersEngine,
) -> None:
    """Through TransformersEngine.generate (which shares): each row's sampling logprobs are
    those of its own prompt and completion in one unpadded forward."""
    from opentinker.spec import SamplingParams

    prompts = group_prompts(engine, samples=3)
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=5), seed=3)
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        want = [
            logprobs[len(prompt) - 1 + k, token].item()
            for k, token in enumerate(completion.token_ids)
        ]
        assert completion.logprobs == pytest.approx(want, abs=1e-4)


def test_rows_share_only_under_the_same_tag(engine: TransformersEngine) -> None:
    """One prompt under two tags (two LoRA adapters): two distinct prefixes, and the forward
    of the distinct prompts gets the rows they came from."""
    prompts = group_prompts(engine, samples=2)[:1] * 4  # one prompt, four rows
    seen: list[list[int]] = []
    inputs = prompt_inputs(
        engine.model,
        prompts,
        engine.pad_token_id,
        engine.device,
        tags=["a", "b", "a", "b"],
        forward_kwargs=lambda rows: seen.append(rows) or {},
    )
    assert seen == [[0, 1]]
    cache = inputs["past_key_values"]
    assert cache.layers[0].keys.shape[0] == 4  # repeated back to one row per sample


def test_prompts_too_short_to_share_take_the_plain_path(engine: TransformersEngine) -> None:
    inputs = prompt_inputs(engine.model, [[5], [5], [5, 6]], engine.pad_token_id, engine.device)
    assert "past_key_values" not in inputs
    with pytest.raises(ValueError, match="empty prompt"):
        prompt_inputs(engine.model, [[], [3, 4]], engine.pad_token_id, engine.device)


def test_a_vision_language_engine_keeps_the_plain_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its rope positions are 3-D and its generate keeps rope state between calls: no cache
    made outside generate, also for text-only prompts."""
    from opentinker.services.modeling.tiny_vl_model import build_tiny_vl_model
    from opentinker.services.rollout.engines import engine as engine_module
    from opentinker.spec import SamplingParams

    vl = TransformersEngine.load(
        ModelSpec(base_model=str(build_tiny_vl_model(tmp_path / "vl")), finetune="full"),
        device="cpu",
    )
    assert vl.image_processor is not None
    shares: list[bool] = []
    real = engine_module.prompt_inputs
    monkeypatch.setattr(
        engine_module,
        "prompt_inputs",
        lambda *args, **kwargs: shares.append(kwargs["share"]) or real(*args, **kwargs),
    )
    prompt = vl.tokenizer("hello there", add_special_tokens=False)["input_ids"]
    completions = vl.generate([prompt] * 4, SamplingParams(max_new_tokens=2), seed=0)
    assert len(completions) == 4 and shares == [False]
