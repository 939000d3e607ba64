"""The gateway's OpenAI-compatible door (/v1), driven by the real ``openai`` client against a
real mesh: a base model and a trained checkpoint served with the same keys, streaming,
n/temperature/stop/logprobs, and OpenAI-shaped 4xx errors naming the field."""

from __future__ import annotations

import openai
import pytest
import tinker
from test_tinker_snapshots import other_tenant_key
from tinker import types
from tinker_gateway_helpers import BASE, gateway, mesh, monkeypatch_module, service, sft_datum
from transformers import AutoTokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]
__all__ = ["gateway", "mesh", "monkeypatch_module", "service"]  # fixtures used here

PROMPT = [5, 9, 13, 17, 21, 25]
CHAT = [{"role": "user", "content": "Answer with the letter B."}]


@pytest.fixture(scope="module")
def trained(service) -> tuple[str, list[int]]:
    """A trained checkpoint's sampler path, and its greedy tokens for PROMPT as a Tinker
    sampling client samples them."""
    trainer = service.create_lora_training_client(base_model=BASE, rank=4).result()
    trainer.forward_backward([sft_datum(PROMPT)], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-1)).result()
    path = trainer.save_weights_for_sampler("oai").result().path
    sampler = service.create_sampling_client(model_path=path).result()
    greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
    answer = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result()
    return path, list(answer.sequences[0].tokens)


@pytest.fixture(scope="module")
def client(gateway, mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=mesh.api_key, max_retries=0)


def test_a_trained_checkpoint_answers_as_its_tinker_sampler(
    client, trained, letter_model_dir
) -> None:
    path, tinker_tokens = trained
    listed = [m.id for m in client.models.list()]
    assert BASE in listed and path in listed
    reply = client.completions.create(
        model=path, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0
    )
    choice = reply.choices[0]
    # The same snapshot through the same sampling path: the same greedy tokens.
    tokenizer = AutoTokenizer.from_pretrained(letter_model_dir)
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in tinker_tokens]
    assert choice.text == tokenizer.decode(tinker_tokens, skip_special_tokens=True)
    assert reply.usage.completion_tokens == len(tinker_tokens)
    assert reply.usage.prompt_tokens == len(PROMPT)
    assert len(choice.logprobs.token_logprobs) == len(tinker_tokens)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)


def test_chat_on_a_base_model_with_n_greedy_logprobs_and_streaming(client) -> None:
    reply = client.chat.completions.create(
        model=BASE, messages=CHAT, max_tokens=4, temperature=0, n=2, logprobs=True
    )
    assert [c.index for c in reply.choices] == [0, 1]
    first, second = (c.message.content for c in reply.choices)
    assert first == second  # greedy: n copies of one answer
    assert reply.choices[0].finish_reason in ("stop", "length")
    tokens = reply.choices[0].logprobs.content
    assert len(tokens) == reply.usage.completion_tokens // 2
    assert all(t.logprob <= 0 for t in tokens)
    stream = client.chat.completions.create(
        model=BASE, messages=CHAT, max_tokens=4, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == first
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason
    sampled = client.chat.completions.create(
        model=BASE, messages=CHAT, max_tokens=3, temperature=0.7, top_p=0.9, seed=3
    )
    assert sampled.usage.completion_tokens <= 3


def test_bad_keys_other_tenants_and_bad_fields_are_4xx_in_openai_shape(
    gateway, mesh, client, trained
) -> None:
    path, _ = trained
    with pytest.raises(openai.AuthenticationError) as bad_key:
        openai.OpenAI(base_url=f"{gateway}/v1", api_key="otk_nope", max_retries=0).models.list()
    assert bad_key.value.status_code == 401
    stranger = openai.OpenAI(
        base_url=f"{gateway}/v1", api_key=other_tenant_key(mesh), max_retries=0
    )
    with pytest.raises(openai.NotFoundError) as refused:
        stranger.completions.create(model=path, prompt=PROMPT, max_tokens=2)
    assert refused.value.body["param"] == "model"
    assert path not in [m.id for m in stranger.models.list()]
    with pytest.raises(openai.BadRequestError) as hot:
        client.chat.completions.create(model=BASE, messages=CHAT, temperature=5)
    assert hot.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError, match="GET /v1/models"):
        client.chat.completions.create(model="no/such-model", messages=CHAT)
    with pytest.raises(openai.BadRequestError) as empty:
        client.chat.completions.create(model=BASE, messages=[])
    assert empty.value.body["param"] == "messages"


def test_topk_logprobs_through_the_tinker_sdk_and_the_openai_door(service, client, trained) -> None:
    path, tinker_tokens = trained
    sampler = service.create_sampling_client(model_path=path).result()
    greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
    prompt = types.ModelInput.from_ints(PROMPT)
    out = sampler.sample(
        prompt,
        1,
        greedy,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=4,
    ).result()
    seq = out.sequences[0]
    rows = seq.topk_logprobs
    assert len(rows) == len(seq.tokens)
    for token, logprob, row in zip(seq.tokens, seq.logprobs, rows, strict=True):
        assert len(row) == 4
        assert [lp for _, lp in row] == sorted((lp for _, lp in row), reverse=True)
        # greedy: the sampled token is the likeliest, with the logprob it was sampled with
        assert row[0][0] == token and row[0][1] == pytest.approx(logprob, abs=1e-3)
    prompt_rows = out.topk_prompt_logprobs
    assert len(prompt_rows) == len(PROMPT) and prompt_rows[0] is None
    for at, row in enumerate(prompt_rows[1:], start=1):
        assert len(row) == 3
        # the prompt token's own logprob is at most the likeliest one's
        assert out.prompt_logprobs[at] <= row[0][1] + 1e-3
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs"):
        sampler.sample(prompt, 1, greedy, topk_sample_logprobs=1000).result()

    chat = client.chat.completions.create(
        model=path, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
    text = client.completions.create(
        model=path, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2
    )
    assert len(text.choices[0].logprobs.top_logprobs) == len(tinker_tokens)
