"""Chunked logprobs: the same values and gradients as the full-logits way, for any chunk size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer.model.logprobs import (
    causal_lm_parts,
    chunk_positions_for,
    logprobs_from_hidden,
    target_logprobs_and_entropy,
    unchunked_token_logprobs_and_entropy,
)
from opentinker.services.trainer.model.policy import Policy
from opentinker.services.trainer.rl.batch import Episode, SequenceBatch, collate
from opentinker.spec import LoraConfig, ModelSpec

pytestmark = pytest.mark.integration  # real tiny model on disk, loaded with from_pretrained


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def padded_batch(pad_id: int) -> SequenceBatch:
    """Three sequences of lengths 9, 13 and 6 (L = 13, T = 12): two rows end in padding."""
    rows = [list(range(40, 49)), list(range(100, 113)), [7, 300, 12, 5, 88, 2]]
    episodes = [
        Episode(0, 0, ids, 3, [0.0] * (len(ids) - 3), [1] * (len(ids) - 3), 0.0, False)
        for ids in rows
    ]
    return collate(episodes, pad_id)


def masked_loss(logprobs_B_T: torch.Tensor, batch: SequenceBatch) -> torch.Tensor:
    """A GRPO-like loss: minus the masked mean of the logprobs, with unequal weights per row."""
    weights_B_1 = torch.tensor([[1.0], [-0.5], [2.0]])
    mask_B_T = batch.loss_mask_B_T
    return -(logprobs_B_T * weights_B_1 * mask_B_T).sum() / mask_B_T.sum()


def values_and_grads(
    policy: Policy, batch: SequenceBatch, compute, entropy_coef: float = 0.0
) -> tuple:
    """Values and parameter gradients of masked_loss, minus an entropy bonus when asked."""
    policy.model.zero_grad(set_to_none=True)
    logprobs_B_T, entropy_B_T = compute()
    loss = masked_loss(logprobs_B_T, batch)
    if entropy_coef:
        mask_B_T = batch.loss_mask_B_T
        loss = loss - entropy_coef * (entropy_B_T * mask_B_T).sum() / mask_B_T.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return logprobs_B_T.detach(), entropy_B_T.detach(), grads


@pytest.mark.parametrize("finetune", ["lora", "lora-head", "full"])
@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # peft, lora-head
def test_chunked_values_and_gradients_equal_the_full_logits_path(
    tiny_model_dir: Path, finetune: str
) -> None:
    torch.manual_seed(0)
    targets = ("q_proj", "v_proj", "lm_head") if finetune == "lora-head" else ("q_proj",)
    lora = LoraConfig(rank=4, target_modules=targets)
    spec = ModelSpec(
        base_model=str(tiny_model_dir), finetune=finetune.removesuffix("-head"), lora=lora
    )
    policy = Policy(spec, learning_rate=1e-3)
    if finetune != "full":  # lora_B starts at zero: move it so the adapter shapes the output
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
    batch = padded_batch(policy.pad_id)
    temperature = 0.7
    full_lp, full_ent, full_grads = values_and_grads(
        policy,
        batch,
        lambda: unchunked_token_logprobs_and_entropy(
            policy.model, batch.tokens_B_L, batch.attention_mask_B_L, temperature=temperature
        ),
    )
    assert full_grads and all(g.abs().sum() > 0 for g in full_grads.values())
    # B * T = 3 * 12 = 36 positions: chunks of 1, 5 and 7 leave a remainder, 12 and 36 divide
    for chunk in (1, 5, 7, 12, 36, 1000):
        policy.logit_chunk_positions = chunk
        lp, ent, grads = values_and_grads(
            policy,
            batch,
            lambda: policy.token_logprobs_and_entropy(batch, temperature=temperature),
        )
        assert lp.shape == full_lp.shape == (3, 12)
        assert torch.allclose(lp, full_lp, atol=1e-5), chunk
        assert torch.allclose(ent, full_ent, atol=1e-5), chunk
        assert grads.keys() == full_grads.keys()
        for name, grad in grads.items():
            assert torch.allclose(grad, full_grads[name], atol=1e-5), (chunk, name)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_an_entropy_bonus_has_the_full_paths_gradient(tiny_model_dir: Path, finetune: str) -> None:
    """The chunked backward also carries d(entropy)/d(logits) = -p (log p + H), the gradient
    of an entropy bonus, equal to autograd's through the full log-softmax."""
    torch.manual_seed(1)
    spec = ModelSpec(base_model=str(tiny_model_dir), finetune=finetune)
    policy = Policy(spec, learning_rate=1e-3)
    batch = padded_batch(policy.pad_id)
    _, _, full_grads = values_and_grads(
        policy,
        batch,
        lambda: unchunked_token_logprobs_and_entropy(
            policy.model, batch.tokens_B_L, batch.attention_mask_B_L, temperature=0.7
        ),
        entropy_coef=0.3,
    )
    _, _, plain_grads = values_and_grads(
        policy,
        batch,
        lambda: policy.token_logprobs_and_entropy(batch, temperature=0.7),
    )
    for chunk in (5, 36):
        policy.logit_chunk_positions = chunk
        _, _, grads = values_and_grads(
            policy,
            batch,
            lambda: policy.token_logprobs_and_entropy(batch, temperature=0.7),
            entropy_coef=0.3,
        )
        for name, grad in grads.items():
            assert torch.allclose(grad, full_grads[name], atol=1e-5), (chunk, name)
    # the bonus changed the gradient: the test would catch a dropped entropy term
    assert any(not torch.allclose(plain_grads[n], full_grads[n], atol=1e-4) for n in full_grads)


def test_padding_positions_are_finite_and_carry_no_gradient(tiny_model_dir: Path) -> None:
    policy = Policy(ModelSpec(base_model=str(tiny_model_dir), finetune="full"), learning_rate=1e-3)
    policy.logit_chunk_positions = 5
    batch = padded_batch(policy.pad_id)
    hidden_B_L_H = policy.hidden_states(batch)
    hidden_B_L_H.retain_grad()
    lp, ent = policy.logprobs_from_hidden(batch, hidden_B_L_H)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    masked_loss(lp, batch).backward()
    # row 2 has 6 real tokens: positions 5.. predict padding, mask 0, so no gradient reaches
    # the hidden states they read (position t's logprob reads hidden t only)
    assert batch.loss_mask_B_T[2, 5:].sum() == 0
    assert hidden_B_L_H.grad[2, 5:].abs().sum() == 0
    assert hidden_B_L_H.grad[2, 2:5].abs().sum() > 0


def test_hidden_states_feed_the_head_the_model_uses(tiny_model_dir: Path) -> None:
    spec = ModelSpec(base_model=str(tiny_model_dir), finetune="lora")
    policy = Policy(spec, learning_rate=1e-3)
    batch = padded_batch(policy.pad_id)
    with torch.no_grad():
        hidden_B_L_H = policy.hidden_states(batch)
        logits_B_L_V = policy.model(
            input_ids=batch.tokens_B_L, attention_mask=batch.attention_mask_B_L
        ).logits
        _, head = causal_lm_parts(policy.model)
        assert hidden_B_L_H.shape == (3, 13, policy.model.config.hidden_size)
        assert torch.allclose(head(hidden_B_L_H), logits_B_L_V, atol=1e-5)
        # without gradients no checkpointing is needed; the values are the same
        lp, _ = logprobs_from_hidden(head, hidden_B_L_H, batch.tokens_B_L, chunk_positions=4)
    assert not lp.requires_grad
    full_lp, _ = unchunked_token_logprobs_and_entropy(
        policy.model, batch.tokens_B_L, batch.attention_mask_B_L
    )
    assert torch.allclose(lp, full_lp.detach(), atol=1e-5)


def test_default_chunk_fits_the_element_budget() -> None:
    # 2**26 elements / 151,936 (Qwen2.5 vocabulary) = 441.7 -> 441 positions per chunk
    assert chunk_positions_for(151_936) == 441
    assert chunk_positions_for(512) == 2**26 // 512
    assert chunk_positions_for(10**9) == 1  # never zero
    with pytest.raises(ValueError, match="chunk_positions"):
        logprobs_from_hidden(
            torch.nn.Linear(4, 8),
            torch.zeros(1, 3, 4),
            torch.zeros(1, 3, dtype=torch.long),
            chunk_positions=0,
        )


def test_a_biased_soft_capped_head_matches_the_plain_computation() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=True)
    hidden_B_L_H = torch.randn(2, 6, 8, requires_grad=True)
    tokens_B_L = torch.randint(0, 50, (2, 6))
    weights_B_T = torch.randn(2, 5)
    lp, ent = logprobs_from_hidden(
        head, hidden_B_L_H, tokens_B_L, temperature=0.6, chunk_positions=3, softcap=2.0
    )
    (lp * weights_B_T).sum().backward()
    chunked = [hidden_B_L_H.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    for t in (hidden_B_L_H, head.weight, head.bias):
        t.grad = None
    # the plain way: capped logits tanh(l / 2) * 2, then log_softmax(. / 0.6), all at once
    capped_B_T_V = torch.tanh(head(hidden_B_L_H[:, :-1]) / 2.0) * 2.0
    expected_lp, expected_ent = target_logprobs_and_entropy(capped_B_T_V, tokens_B_L[:, 1:], 0.6)
    (expected_lp * weights_B_T).sum().backward()
    assert torch.allclose(lp, expected_lp, atol=1e-6)
    assert torch.allclose(ent, expected_ent, atol=1e-6)
    plain = [hidden_B_L_H.grad, head.weight.grad, head.bias.grad]
    for got, want in zip(chunked, plain, strict=True):
        assert torch.allclose(got, want, atol=1e-6)


def test_a_model_whose_forward_rescales_logits_is_refused_at_start(tmp_path: Path) -> None:
    """Cohere's forward multiplies the head's logits by ``logit_scale``: training on the head's
    own logits would not train the distribution the model samples from."""
    from transformers import CohereConfig, CohereForCausalLM

    from opentinker.errors import ConfigError
    from opentinker.services.modeling.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = CohereConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        logit_scale=0.25,
        pad_token_id=tokenizer.pad_token_id,
    )
    CohereForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="CohereForCausalLM.*not supported"):
        Policy(ModelSpec(base_model=str(tmp_path), finetune="full"), learning_rate=1e-3)


def test_given_targets_are_scored_instead_of_the_next_tokens(tiny_model_dir: Path) -> None:
    """Tinker's target_tokens may be any token (e.g. 0 on prompt positions): position t then
    holds log p(target t | tokens 0..t), the same column of the same distribution."""
    policy = Policy(ModelSpec(base_model=str(tiny_model_dir), finetune="full"), learning_rate=1e-3)
    batch = padded_batch(policy.pad_id)
    targets_B_T = torch.zeros_like(batch.tokens_B_L[:, 1:])
    targets_B_T[:, 1::2] = 7  # column 0 on even positions, 7 on odd ones
    with torch.no_grad():
        got_B_T, _ = policy.token_logprobs_and_entropy(batch, targets_B_T=targets_B_T)
        logits = policy.model(
            input_ids=batch.tokens_B_L, attention_mask=batch.attention_mask_B_L
        ).logits
    full_B_T_V = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    want_B_T = full_B_T_V.gather(-1, targets_B_T.unsqueeze(-1)).squeeze(-1)
    mask = batch.attention_mask_B_L[:, 1:].bool()
    assert torch.allclose(got_B_T[mask], want_B_T[mask], atol=1e-5)


def rows_seen_by_head(head: torch.nn.Module) -> tuple[list[int], object]:
    """How many positions each call of ``head`` computed (forward and recomputing backward)."""
    seen: list[int] = []
    return seen, head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_the_head_runs_only_at_wanted_positions_with_the_same_values_and_gradients(
    tiny_model_dir: Path, finetune: str
) -> None:
    """A multi-turn loss mask (model tokens, an env reply at 0, model tokens) and padding: the
    head computes only the positions the loss reads, which hold the values and give the
    gradients of the all-positions pass (an entropy bonus included); every other is 0."""
    torch.manual_seed(2)
    spec = ModelSpec(base_model=str(tiny_model_dir), finetune=finetune)
    policy = Policy(spec, learning_rate=1e-3)
    policy.logit_chunk_positions = 4
    batch = padded_batch(policy.pad_id)
    mask_B_T = batch.loss_mask_B_T.clone()
    mask_B_T[1, 4:8] = 0  # row 1: an env reply in the middle of its completion
    batch = SequenceBatch(batch.tokens_B_L, batch.attention_mask_B_L, mask_B_T,
                          batch.old_logprobs_B_T)  # fmt: skip
    wanted_B_T = mask_B_T > 0
    _, head = causal_lm_parts(policy.model)
    every, wanted = {}, {}
    for given, figures in ((None, every), (wanted_B_T, wanted)):
        seen, hook = rows_seen_by_head(head)
        figures["values"] = values_and_grads(
            policy,
            batch,
            lambda g=given: policy.token_logprobs_and_entropy(
                batch, temperature=0.7, wanted_B_T=g
            ),  # fmt: skip
            entropy_coef=0.3,
        )
        hook.remove()
        figures["rows"] = sum(seen)
    lp, ent, grads = wanted["values"]
    all_lp, all_ent, all_grads = every["values"]
    assert torch.allclose(lp[wanted_B_T], all_lp[wanted_B_T], atol=1e-6)
    assert torch.allclose(ent[wanted_B_T], all_ent[wanted_B_T], atol=1e-6)
    assert not lp[~wanted_B_T].any() and not ent[~wanted_B_T].any()
    assert grads.keys() == all_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, all_grads[name], atol=1e-6), name
    # forward + the backward's recomputation: 2 passes over 36 positions, or over the 15 read
    count = int(wanted_B_T.sum())
    assert count == 15 and every["rows"] == 2 * 36 and wanted["rows"] == 2 * count


def test_nothing_wanted_gives_zeros_and_a_backward_that_runs(tiny_model_dir: Path) -> None:
    policy = Policy(ModelSpec(base_model=str(tiny_model_dir), finetune="full"), learning_rate=1e-3)
    batch = padded_batch(policy.pad_id)
    nothing_B_T = torch.zeros_like(batch.loss_mask_B_T, dtype=torch.bool)
    lp, ent = policy.token_logprobs_and_entropy(batch, wanted_B_T=nothing_B_T)
    assert lp.shape == ent.shape == (3, 12) and not lp.any() and not ent.any()
    (lp * 0.0).sum().backward()  # a micro-batch without trained tokens still steps
