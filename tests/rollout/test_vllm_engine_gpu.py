"""The vLLM engine on a GPU, on a Qwen2.5-0.5B-shaped model built here with random init.

Each test is checked against the transformers engine on the same GPU (bf16 both sides, so
within placement.py's documented bf16 tolerance): sampled logprobs against a recompute, the
probe after a LoRA hot-load and after a full-weight update in place. Skipped with the reason
on a machine without CUDA or without the ``vllm`` extra; ``bench/gpu_check.sh`` runs them on
a lent GPU machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from vllm_gpu_helpers import gpu_test_model, max_diff, prompts

from opentinker.services.modeling.placement import probe_tolerance
from opentinker.services.rollout.engines.engine import TransformersEngine, WeightUpdateError
from opentinker.services.rollout.engines.engine_choice import vllm_installed
from opentinker.services.rollout.settings import RolloutSettings
from opentinker.spec import LoraConfig, ModelSpec, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none here"),
    pytest.mark.skipif(not vllm_installed(), reason="needs the vllm extra (not installed)"),
]

TOL = probe_tolerance(torch.bfloat16, torch.bfloat16)  # 5e-2: two bf16 kernels
LORA = LoraConfig(rank=8, alpha=16.0)
SETTINGS = RolloutSettings(gpu_memory_utilization=0.25, vllm_enforce_eager=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpu_test_model(tmp_path_factory)


def load_vllm(spec: ModelSpec) -> Iterator:
    from opentinker.services.rollout.engines.vllm_engine import VllmEngine

    engine = VllmEngine.load(spec, SETTINGS, device="cuda:0")
    yield engine
    engine.close()


# Class-scoped: one vLLM engine at a time on the GPU (each is closed before the next starts).
@pytest.fixture(scope="class")
def full_pair(model_dir: Path) -> Iterator[tuple]:
    spec = ModelSpec(base_model=str(model_dir), finetune="full")
    reference = TransformersEngine.load(spec, device="cuda:0")
    for engine in load_vllm(spec):
        yield engine, reference
    del reference
    torch.cuda.empty_cache()


@pytest.fixture(scope="class")
def lora_pair(model_dir: Path) -> Iterator[tuple]:
    spec = ModelSpec(base_model=str(model_dir), finetune="lora", lora=LORA)
    reference = TransformersEngine.load(spec, device="cuda:0")
    for engine in load_vllm(spec):
        yield engine, reference


def recompute(reference: TransformersEngine, prompt: list[int], tokens: list[int], t: float):
    ids = torch.tensor([prompt + tokens], device=reference.device)
    with torch.no_grad():
        logits = reference.model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits / t, dim=-1)
    start = len(prompt) - 1
    return [logprobs[start + i, tok].item() for i, tok in enumerate(tokens)]


class TestFullWeights:
    """A full fine-tune's engine: sampling, greedy, updates in place."""

    def test_sampled_logprobs_match_the_transformers_recompute(self, full_pair) -> None:
        engine, reference = full_pair
        batch = prompts(engine)
        sampling = SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=24)
        engine.seed_per_request = True  # OPENTINKER_ROLLOUT_VLLM_SEED_PER_REQUEST=true
        engine.llm.reset_prefix_cache()  # both runs prefill the same way (no cached prefix)
        first = engine.generate(batch, sampling, seed=11)
        engine.llm.reset_prefix_cache()
        again = engine.generate(batch, sampling, seed=11)
        assert [c.token_ids for c in first] == [c.token_ids for c in again], "same seed: same"
        assert [c.token_ids for c in first] != [
            c.token_ids for c in engine.generate(batch, sampling, seed=12)
        ]
        engine.seed_per_request = False  # the default: the engine's generator draws on
        drawn = [[c.token_ids for c in engine.generate(batch, sampling, seed=11)] for _ in "ab"]
        assert drawn[0] != drawn[1], "unseeded rows draw on from the engine's generator"
        worst = 0.0
        for prompt, completion in zip(batch, first, strict=True):
            assert 1 <= len(completion.token_ids) <= 24
            assert len(completion.logprobs) == len(completion.token_ids)
            expected = recompute(reference, prompt, completion.token_ids, 0.8)
            worst = max(worst, max_diff(completion.logprobs, expected))
        print(
            f"\nvLLM sampled logprobs vs transformers recompute: max |d| = {worst:.4f} (tol {TOL})"
        )
        assert worst < TOL
        probe = batch[3] + first[3].token_ids
        assert max_diff(engine.logprobs_of(probe), reference.logprobs_of(probe)) < TOL

    def test_the_context_length_is_the_one_the_transformers_engine_reads(self, full_pair) -> None:
        """SampleTokens/ScoreTokens refuse past ``max_model_len``: vLLM's, read from its
        engine, must be the model config's, as the transformers engine reads it."""
        engine, reference = full_pair
        assert engine.max_model_len == reference.max_model_len > 0

    def test_greedy_picks_the_argmax_with_temperature_1_logprobs(self, full_pair) -> None:
        engine, reference = full_pair
        batch = prompts(engine, 4)
        greedy = engine.generate(batch, SamplingParams(max_new_tokens=8), seed=0, greedy=True)
        for prompt, completion in zip(batch, greedy, strict=True):
            ids = torch.tensor([prompt], device=reference.device)
            with torch.no_grad():
                logprobs = torch.log_softmax(
                    reference.model(input_ids=ids).logits[0, -1].float(), -1
                )
            first = completion.token_ids[0]
            # Near-uniform random logits: bf16 rounding may swap the top two, never more.
            assert logprobs[first] >= logprobs.max() - TOL
            assert completion.logprobs[0] == pytest.approx(logprobs[first].item(), abs=TOL)
            eos = engine.eos_token_id
            assert eos not in completion.token_ids[:-1], "nothing is generated past eos"

    def test_a_full_weight_update_is_applied_in_place_and_the_probe_passes(self, full_pair) -> None:
        engine, reference = full_pair
        probe = prompts(engine, 1)[0] + list(range(100, 140))
        before = engine.logprobs_of(probe)
        params = dict(reference.model.named_parameters())
        generator = torch.Generator(device="cuda").manual_seed(0)
        names = [n for n in params if n.endswith(("q_proj.weight", "down_proj.weight"))]
        update = {
            n: params[n].detach().float()
            + 0.02 * torch.randn(params[n].shape, device="cuda", generator=generator)
            for n in names
        }
        with pytest.raises(WeightUpdateError, match="does not have"):
            engine.apply_weights({"model.nope.weight": torch.zeros(2)}, policy_version=1)
        assert engine.policy_version == 0
        assert engine.logprobs_of(probe) == pytest.approx(before, abs=1e-3)
        half = len(names) // 2  # streamed in two parts, as the session applies a large update
        engine.apply_weights({n: update[n].cpu() for n in names[:half]}, policy_version=0)
        engine.apply_weights({n: update[n].cpu() for n in names[half:]}, policy_version=1)
        reference.apply_weights(update, policy_version=1)
        after = engine.logprobs_of(probe)
        moved = max_diff(after, before)
        agreed = max_diff(after, reference.logprobs_of(probe))
        print(f"\nfull update: probe moved {moved:.3f}, vs the transformers engine {agreed:.4f}")
        assert engine.policy_version == 1
        # A stale engine would still serve `before`: the update must move the probe by more
        # than the tolerance for the agreement below to prove anything.
        assert moved > 2 * TOL, "the update changed what vLLM serves (no stale weights)"
        assert agreed < TOL


class TestLora:
    """A LoRA job's engine: adapter versions hot-loaded."""

    def test_lora_versions_are_hot_loaded_and_the_probe_passes(self, lora_pair) -> None:
        engine, reference = lora_pair
        probe = prompts(engine, 1)[0] + list(range(200, 240))
        base = engine.logprobs_of(probe)
        assert max_diff(base, reference.logprobs_of(probe)) < TOL  # B = 0: the base model
        sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
        base_out = engine.generate(prompts(engine, 4), sampling, seed=5)
        shapes = {n: p.shape for n, p in reference.model.named_parameters() if p.requires_grad}
        moved, ids, folders = 0.0, [], []
        for version in (1, 2):
            generator = torch.Generator().manual_seed(version)
            update = {n: 0.05 * torch.randn(s, generator=generator) for n, s in shapes.items()}
            engine.apply_weights(update, policy_version=version)
            reference.apply_weights(update, policy_version=version)
            served = engine.logprobs_of(probe)
            agreed = max_diff(served, reference.logprobs_of(probe))
            moved = max_diff(served, base)
            print(f"\nLoRA v{version}: probe moved {moved:.3f}, vs transformers+peft {agreed:.4f}")
            assert engine.policy_version == version
            ids.append(engine.lora_request.lora_int_id)
            folders.append(Path(engine.lora_request.lora_path))
            assert agreed < TOL
        assert moved > 2 * TOL, "the adapter changed what vLLM serves"
        assert ids[0] != ids[1]
        assert engine.llm.llm_engine.list_loras() == {ids[1]}, "the previous one was removed"
        # A version sent again (a retried sync) is loaded under a new id, not the cached one.
        engine.apply_weights(update, policy_version=2)
        assert engine.lora_request.lora_int_id not in ids
        assert max_diff(engine.logprobs_of(probe), served) < TOL
        assert not folders[0].exists() and not folders[1].exists()  # replaced by the re-sent one
        assert Path(engine.lora_request.lora_path).is_dir()
        lora_out = engine.generate(prompts(engine, 4), sampling, seed=5)
        assert [c.logprobs for c in lora_out] != [c.logprobs for c in base_out]
