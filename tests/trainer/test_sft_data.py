"""SFT data: rows read with clear errors, loss masks only on assistant tokens, packing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from opentinker.services.modeling.tiny_model import ensure_tiny_model
from opentinker.services.trainer.sft.batches import make_batches
from opentinker.services.trainer.sft.data import (
    Conversation,
    DatasetError,
    Example,
    Message,
    read_conversations,
    render,
    render_all,
    split_validation,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def chat(*messages: tuple[str, str] | tuple[str, str, float]) -> Conversation:
    return Conversation(tuple(Message(*m) for m in messages), where="test")


def test_mask_is_one_only_on_assistant_reply_and_its_end_token(tokenizer) -> None:
    conversation = chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Yo"))
    example = render(tokenizer, conversation, max_length=1000)

    # The ChatML template renders (im_start = id 1, im_end = id 2 in the tiny tokenizer):
    #   "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    #   "<|im_start|>assistant\n"      the reply header: written by the template, weight 0
    #   "Yo<|im_end|>"                 the reply and its end-of-turn token: weight 1
    #   "\n"                           after the end-of-turn token: weight 0
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prompt = ids(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    reply, after = ids("Yo<|im_end|>"), ids("\n")
    assert example.token_ids == prompt + reply + after
    assert example.weights == [0.0] * len(prompt) + [1.0] * len(reply) + [0.0] * len(after)
    assert reply[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    trained = [t for t, w in zip(example.token_ids, example.weights, strict=True) if w]
    assert tokenizer.decode(trained) == "Yo<|im_end|>"


def test_the_reply_ends_at_its_end_of_turn_token_when_the_eos_is_another(model_dir) -> None:
    """A base model's eos (Qwen2.5's <|endoftext|>) is not the template's <|im_end|>: the
    trained span ran to the message's end, the "\n" after <|im_end|> included."""
    base = AutoTokenizer.from_pretrained(model_dir, eos_token="<|endoftext|>")
    assert base.eos_token_id != base.convert_tokens_to_ids("<|im_end|>")
    example = render(base, chat(("user", "Hi"), ("assistant", "Yo")), max_length=1000)
    trained = [t for t, w in zip(example.token_ids, example.weights, strict=True) if w]
    assert base.decode(trained) == "Yo<|im_end|>"


def test_message_weights_multiply_and_zero_excludes(tokenizer) -> None:
    conversation = chat(
        ("user", "a"), ("assistant", "b", 0.5), ("user", "c"), ("assistant", "d", 0.0)
    )
    example = render(tokenizer, conversation, max_length=1000)
    by_weight: dict[float, list[int]] = {}
    for token, weight in zip(example.token_ids, example.weights, strict=True):
        by_weight.setdefault(weight, []).append(token)
    # Only the first reply "b<|im_end|>" is trained, at weight 0.5; "d" (weight 0) is not.
    assert set(by_weight) == {0.0, 0.5}
    assert tokenizer.decode(by_weight[0.5]) == "b<|im_end|>"
    assert "d" in tokenizer.decode(by_weight[0.0])


def test_truncation_keeps_the_first_tokens(tokenizer) -> None:
    conversation = chat(("user", "one two three"), ("assistant", "four five six seven"))
    full = render(tokenizer, conversation, max_length=1000)
    cut = render(tokenizer, conversation, max_length=len(full.token_ids) - 3)
    assert cut.token_ids == full.token_ids[:-3] and cut.weights == full.weights[:-3]
    # Cut before the reply: nothing left to train on, so render_all drops it (and refuses if
    # nothing is left at all).
    with pytest.raises(DatasetError, match="no conversation has an assistant token"):
        render_all(tokenizer, [conversation], max_length=4)


def test_bad_rows_name_the_file_and_line(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    cases = {
        "not json": "not valid JSON",
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}): "messages[0].role",
        json.dumps({"messages": [{"role": "user", "content": 3}]}): "messages[0].content",
        json.dumps({"msgs": []}): 'a row must be an object {"messages"',
        json.dumps({"messages": [{"role": "user", "content": "q"}]}): "no assistant message",
        json.dumps(
            {"messages": [{"role": "assistant", "content": "a", "weight": -1}]}
        ): "messages[0].weight",
    }
    for bad, expected in cases.items():
        path = tmp_path / "chat.jsonl"
        path.write_text(json.dumps(good) + "\n\n" + bad + "\n")
        with pytest.raises(DatasetError, match=re.escape(expected)) as info:
            read_conversations(path)
        assert f"{path}:3" in str(info.value)  # line 3 (the blank line counts)
    with pytest.raises(DatasetError, match="does not exist"):
        read_conversations(tmp_path / "missing.jsonl")


def test_parquet_rows_are_read_and_bad_ones_named(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "q2"}],
    ]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"messages": rows[:1]}), path)
    assert read_conversations(path)[0].messages[1] == Message("assistant", "a", 1.0)
    pq.write_table(pa.table({"messages": rows}), path)
    with pytest.raises(DatasetError, match=r"chat.parquet row 2: no assistant message"):
        read_conversations(path)


def test_validation_split_is_seeded_and_never_empty() -> None:
    rows = [chat(("user", str(i)), ("assistant", "x")) for i in range(20)]
    train, val = split_validation(rows, fraction=0.1, seed=3)
    assert len(val) == 2 and len(train) == 18 and not set(train) & set(val)
    assert (train, val) == split_validation(rows, fraction=0.1, seed=3)
    assert len(split_validation(rows[:3], fraction=0.01, seed=0)[1]) == 1


def example(n: int, first: int) -> Example:
    return Example(list(range(first, first + n)), [0.0] + [1.0] * (n - 1))


def test_packing_fills_rows_within_the_budget_and_restarts_positions() -> None:
    examples = [example(n, 10 * i) for i, n in enumerate([5, 3, 6, 2, 4])]
    batches = make_batches(examples, max_tokens=16, max_length=8, packing=True, pad_id=0)
    # Rows (<= 8 tokens, in order): [5+3], [6+2], [4]; the budget of 16 tokens holds two rows
    # of 8, so: batch 1 = rows [5+3] and [6+2] (2 x 8 = 16), batch 2 = row [4] (1 x 4).
    assert [tuple(b.tokens_B_L.shape) for b in batches] == [(2, 8), (1, 4)]
    assert all(b.num_tokens <= 16 for b in batches)
    assert sum(b.num_examples for b in batches) == len(examples)
    first = batches[0]
    assert first.tokens_B_L[0].tolist() == [0, 1, 2, 3, 4, 10, 11, 12]
    assert first.position_ids_B_L[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    # Each conversation's first token has weight 0: nothing of its own predicts it.
    assert first.weights_B_L[0].tolist() == [0, 1, 1, 1, 1, 0, 1, 1]


def test_padding_puts_one_conversation_per_row() -> None:
    examples = [example(n, 10 * i) for i, n in enumerate([5, 3, 6])]
    batches = make_batches(examples, max_tokens=12, max_length=8, packing=False, pad_id=99)
    # Rows padded to the longest of their batch: [5, 3] -> 2 x 5 = 10 <= 12; adding the 6
    # would make 3 x 6 = 18 > 12, so it starts batch 2.
    assert [tuple(b.tokens_B_L.shape) for b in batches] == [(2, 5), (1, 6)]
    assert batches[0].tokens_B_L[1].tolist() == [10, 11, 12, 99, 99]
    assert batches[0].position_ids_B_L[1].tolist() == [0, 1, 2, 0, 1]  # padding: own segment
    assert batches[0].weights_B_L[1].tolist() == [0, 1, 1, 0, 0]


def test_packed_conversations_do_not_attend_to_each_other(model_dir: Path, tokenizer) -> None:
    """The logits of a conversation are the same alone and packed behind another one."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    a = render(tokenizer, chat(("user", "first one"), ("assistant", "ok")), max_length=100)
    b = render(tokenizer, chat(("user", "another"), ("assistant", "fine")), max_length=100)
    (packed,) = make_batches([a, b], max_tokens=200, max_length=100, packing=True, pad_id=0)
    with torch.no_grad():
        both = model(
            input_ids=packed.tokens_B_L, position_ids=packed.position_ids_B_L, use_cache=False
        ).logits
        alone = model(input_ids=torch.tensor([b.token_ids])).logits
    n = len(a.token_ids)
    torch.testing.assert_close(both[0, n:], alone[0], atol=1e-5, rtol=1e-5)
