"""Top-k next-token logprobs from the transformers engines (Tinker's topk_*_logprobs): each
row is the trainer's distribution's k likeliest tokens, per adapter on the shared engine;
an engine without them refuses top_k naming it."""

from __future__ import annotations

import pytest
import torch
from test_multi_lora_engine import model_dir, prompts, spec_of, two_jobs

from opentinker.errors import InvalidArgumentError
from opentinker.services.rollout.engines.engine import TransformersEngine
from opentinker.services.rollout.engines.top_logprobs import check_top_k, engine_top_logprobs

pytestmark = pytest.mark.integration
__all__ = ["model_dir", "two_jobs"]  # fixtures used here


def test_each_adapters_rows_are_its_trainers_top_k(two_jobs) -> None:  # noqa: ANN001
    engine, trainers = two_jobs
    ids = prompts(engine)[1]
    k = 3
    for adapter in ("job_a", "job_b"):
        top_ids, top_lps = engine.adapter_top_logprobs_of(adapter, ids, k)
        assert len(top_ids) == len(top_lps) == (len(ids) - 1) * k
        with torch.no_grad():
            logits = trainers[adapter](input_ids=torch.tensor([ids])).logits[0, :-1].float()
        want_lps, want_ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        assert top_ids == want_ids.flatten().tolist()
        assert top_lps == pytest.approx(want_lps.flatten().tolist(), abs=1e-4)
    a = engine.adapter_top_logprobs_of("job_a", ids, k)[1]
    b = engine.adapter_top_logprobs_of("job_b", ids, k)[1]
    assert a != pytest.approx(b, abs=1e-3)  # each adapter its own distribution


def test_an_engine_without_top_k_refuses_it_naming_the_field() -> None:
    class NoTopK:
        name = "vllm"

    with pytest.raises(InvalidArgumentError, match="top_k: .*vllm"):
        engine_top_logprobs(NoTopK(), [1, 2, 3], 2)
    with pytest.raises(InvalidArgumentError, match="top_k: 65"):
        check_top_k(65)


def test_a_transformers_engines_rows_hold_the_logprobs_it_scores(model_dir) -> None:  # noqa: ANN001
    engine = TransformersEngine.load(spec_of(model_dir), device="cpu")
    ids = engine.tokenizer.encode("one two three four")
    top_ids, top_lps = engine_top_logprobs(engine, ids, 2)
    assert len(top_ids) == (len(ids) - 1) * 2
    argmax = [ids[0], *top_ids[::2]]  # each position's likeliest next token
    scored = engine.logprobs_of(argmax[: len(ids)])
    # the first id followed by its likeliest next token scores as the first row's first entry
    assert scored[0] == pytest.approx(top_lps[0], abs=1e-4)
    assert all(a >= b for a, b in zip(top_lps[::2], top_lps[1::2], strict=True))
