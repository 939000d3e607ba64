"""Supervised fine-tuning with the session primitives: cross_entropy on assistant tokens only.

    python examples/session_sft_chat.py --scheduler 127.0.0.1:50051 --model Qwen/Qwen2.5-0.5B
"""

from __future__ import annotations

import argparse

from transformers import AutoTokenizer

import opentinker
from opentinker import AdamParams, Datum

CHATS = [  # a tiny chat set, made here: the assistant answers the letter after the one named
    [{"role": "user", "content": f"Which letter comes after {a}?"},
     {"role": "assistant", "content": b}]
    for a, b in zip("ABCDEFGH", "BCDEFGHI", strict=True)
]


def to_datum(tokenizer, chat: list[dict]) -> Datum:
    """Train on the assistant's answer (and its end token), not on the prompt."""
    prompt = tokenizer.apply_chat_template(chat[:-1], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    answer = tokenizer.encode(chat[-1]["content"], add_special_tokens=False)
    tokens = prompt + answer + [tokenizer.eos_token_id]
    weights = [0.0] * len(prompt) + [1.0] * (len(answer) + 1)
    return Datum.from_sequence(tokens, weights=weights)


def train(client: opentinker.Client, base_model: str, *, steps: int = 8,
          learning_rate: float = 1e-4, lora_rank: int | None = 8) -> list[float]:
    """Full-batch SFT; returns the mean per-token loss before each step."""
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    data = [to_datum(tokenizer, chat) for chat in CHATS]
    trained_tokens = sum(sum(d.weights or []) for d in data)
    losses = []
    with client.training_session(base_model=base_model, lora_rank=lora_rank) as session:
        for step in range(steps):
            # Futures, Tinker-style: both calls are queued at once and run in this order.
            backward = session.forward_backward_async(data, "cross_entropy")
            update = session.optim_step_async(AdamParams(learning_rate=learning_rate))
            losses.append(backward.result().loss / trained_tokens)
            update.result()
            print(f"step {step + 1}: loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", default="127.0.0.1:50051")
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    with opentinker.Client(args.scheduler) as client:
        train(client, args.model)
