"""Chat data for SFT: read rows, render them with the chat template, mark what is trained.

A row is ``{"messages": [{"role": ..., "content": ..., "weight": ...?}, ...]}`` in a .jsonl
file (one row a line) or a .parquet file (a ``messages`` column of such lists). Only assistant
messages are trained on: their content and end-of-turn token, each token weighted by its
message's ``weight`` (default 1; 0 excludes the message). Everything else -- system and user
turns, tool results, the ``<|im_start|>assistant\\n`` header the template writes before a
reply, and whatever the template writes after the end-of-turn token -- has weight 0.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from transformers import PreTrainedTokenizerBase

from opentinker.errors import ConfigError
from opentinker.services.modeling.template_choice import NO_TEMPLATE_HINT

ROLES = ("system", "user", "assistant", "tool")


class DatasetError(ConfigError):
    """A dataset file is missing, unreadable, or has a bad row (the message names where)."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    weight: float = 1.0


@dataclass(frozen=True)
class Conversation:
    """One row; ``where`` names it for error messages (``file.jsonl:12``)."""

    messages: tuple[Message, ...]
    where: str


@dataclass(frozen=True)
class Example:
    """A rendered conversation: ``token_ids`` and, per token, the weight of predicting it
    (0 = not trained on). ``len(weights) == len(token_ids)``; ``weights[0]`` is always 0, since
    nothing before it predicts the first token."""

    token_ids: list[int]
    weights: list[float]

    @property
    def trained_tokens(self) -> int:
        return sum(1 for w in self.weights if w > 0)


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every row of a .jsonl or .parquet file; raises DatasetError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset {path} does not exist on this node (or is not a file)")
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)
    conversations = [_conversation(row, where) for where, row in rows]
    if not conversations:
        raise DatasetError(f"dataset {path} has no rows")
    return conversations


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{where}: not valid JSON ({err.msg})") from err


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as err:
        raise DatasetError(f"{path}: not a readable parquet file ({err})") from err
    if "messages" not in table.column_names:
        raise DatasetError(f"{path}: no `messages` column (columns: {table.column_names})")
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path} row {number}", row


def _conversation(row: object, where: str) -> Conversation:
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise DatasetError(f'{where}: a row must be an object {{"messages": [...]}}')
    messages = []
    for index, item in enumerate(row["messages"]):
        at = f"{where}: messages[{index}]"
        if not isinstance(item, dict):
            raise DatasetError(f"{at}: must be an object with role and content")
        role, content, weight = item.get("role"), item.get("content"), item.get("weight")
        if role not in ROLES:
            raise DatasetError(f"{at}.role: must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise DatasetError(f"{at}.content: must be a string, got {type(content).__name__}")
        if weight is None:
            weight = 1.0
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise DatasetError(f"{at}.weight: must be a number >= 0, got {weight!r}")
        if not (math.isfinite(weight) and weight >= 0):
            raise DatasetError(f"{at}.weight: must be a number >= 0, got {weight!r}")
        messages.append(Message(role, content, float(weight)))
    if not any(m.role == "assistant" for m in messages):
        raise DatasetError(f"{where}: no assistant message, nothing to train on")
    return Conversation(tuple(messages), where)


def render(
    tokenizer: PreTrainedTokenizerBase, conversation: Conversation, *, max_length: int
) -> Example:
    """Token ids of the whole conversation (chat template) and the weight of each token,
    truncated to its first ``max_length`` tokens.

    Message i's tokens are those the template adds when message i is appended: rendering
    is incremental (checked), so every token belongs to exactly one message.
    """
    if not tokenizer.chat_template:
        raise DatasetError(
            f"the model's tokenizer has no chat template; SFT on messages needs one: "
            f"{NO_TEMPLATE_HINT}"
        )
    token_ids: list[int] = []
    weights: list[float] = []
    for i, message in enumerate(conversation.messages):
        upto = _template_ids(tokenizer, conversation.messages[: i + 1])
        if upto[: len(token_ids)] != token_ids:
            raise DatasetError(
                f"{conversation.where}: the chat template does not render this conversation "
                f"incrementally (message {i} changes the tokens before it)"
            )
        trained = _trained_span(tokenizer, conversation, i, upto, start=len(token_ids))
        for position in range(len(token_ids), len(upto)):
            inside = trained[0] <= position < trained[1]
            weights.append(message.weight if inside else 0.0)
        token_ids = upto
        if len(token_ids) >= max_length:
            break
    if weights:
        weights[0] = 0.0
    return Example(token_ids[:max_length], weights[:max_length])


def _trained_span(
    tokenizer: PreTrainedTokenizerBase,
    conversation: Conversation,
    index: int,
    ids: list[int],
    *,
    start: int,
) -> tuple[int, int]:
    """[first, last) token positions of message ``index`` that are trained: for an assistant
    message, after the template's reply header, through its last end-of-turn token.
    ``ids``: the conversation rendered up to this message; ``start``: where the message begins."""
    if conversation.messages[index].role != "assistant":
        return (0, 0)
    header = _template_ids(tokenizer, conversation.messages[:index], generation_prompt=True)
    first = max(start, len(header))
    end = len(ids)
    ends_turn = end_of_turn_ids(tokenizer)
    last = end
    if any(t in ends_turn for t in ids[first:end]):
        last = first + max(k for k, t in enumerate(ids[first:end]) if t in ends_turn) + 1
    return (first, last)


# Chat templates' end-of-turn tokens (ChatML, Llama 3, Gemma, Phi-3)
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The eos and every known end-of-turn token the vocabulary has. A base model's eos
    (Qwen2.5's ``<|endoftext|>``) is not its chat template's ``<|im_end|>``: with the eos
    alone the trained span ran past ``<|im_end|>`` to the message's end (its ``\n``)."""
    eos = tokenizer.eos_token_id
    found: set[int] = set() if eos is None else {int(eos)}
    for token in END_OF_TURN_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == token:
            found.add(token_id)
    return found


def _template_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: tuple[Message, ...],
    *,
    generation_prompt: bool = False,
) -> list[int]:
    if not messages:
        text = tokenizer.apply_chat_template(
            [], tokenize=False, add_generation_prompt=generation_prompt
        )
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []
    ids = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        tokenize=True,
        return_dict=False,
        add_generation_prompt=generation_prompt,
    )
    # tokenize=True, return_dict=False: a list of ids (transformers types every form it has).
    return [int(i) for i in cast("list[int]", ids)]


def render_all(
    tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation], *, max_length: int
) -> list[Example]:
    """Rendered conversations, dropping those left with nothing to train on (e.g. truncated
    before the first reply, or every reply weighted 0); raises DatasetError if none is left."""
    examples = [render(tokenizer, c, max_length=max_length) for c in conversations]
    kept = [e for e in examples if e.trained_tokens > 0]
    if not kept:
        raise DatasetError(
            f"no conversation has an assistant token to train on within max_sequence_length "
            f"{max_length} (of {len(examples)} rows)"
        )
    return kept


def split_validation(
    conversations: list[Conversation], *, fraction: float, seed: int
) -> tuple[list[Conversation], list[Conversation]]:
    """(train, validation): a seeded shuffle, then ``fraction`` of the rows (at least one,
    never all) held out."""
    if len(conversations) < 2:
        raise DatasetError(
            f"{len(conversations)} row(s) cannot be split into training and validation; "
            "give more rows or a validation_path"
        )
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    held = min(len(order) - 1, max(1, round(fraction * len(order))))
    validation = [conversations[i] for i in sorted(order[:held])]
    train = [conversations[i] for i in sorted(order[held:])]
    return train, validation
