"""GRPO on the `letter` env, written by hand with the session primitives.

    python examples/session_grpo_letter.py --scheduler 127.0.0.1:50051 --model Qwen/Qwen2.5-0.5B

Sample a group per prompt, score it with the letter game's own code, turn rewards into
group-normalised advantages, then forward_backward (importance_sampling), optim_step and
save_weights_for_sampler so the next samples come from the new weights.
"""

from __future__ import annotations

import argparse
import statistics

from transformers import AutoTokenizer

import opentinker
from opentinker import AdamParams, Datum, SamplingParams
from opentinker.services.envhub.games.letter_env import LetterGame


def train(client: opentinker.Client, base_model: str, *, steps: int = 10, prompts: int = 8,
          group: int = 8, learning_rate: float = 1e-3, num_letters: str = "4") -> list[float]:
    """Run GRPO; returns the mean reward of each step."""
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    mean_rewards = []
    with client.training_session(base_model=base_model, lora_rank=None) as session:
        for step in range(steps):
            data, rewards = [], []
            for p in range(prompts):
                game = LetterGame()
                question = game.reset(seed=step * prompts + p, num_letters=num_letters)
                prompt = tokenizer.apply_chat_template(
                    [{"role": "system", "content": game.get_system_prompt()},
                     {"role": "user", "content": question}],
                    add_generation_prompt=True, tokenize=True, return_dict=False)
                out = session.sample(prompt, num_samples=group,
                                     sampling=SamplingParams(max_new_tokens=4))
                scores = [game.step(tokenizer.decode(s.tokens, skip_special_tokens=True)).reward
                          for s in out.sequences]
                rewards += scores
                mean, std = statistics.fmean(scores), statistics.pstdev(scores)
                if std == 0:
                    continue  # the whole group scored alike: no signal
                for s, reward in zip(out.sequences, scores, strict=True):
                    # Each sequence's tokens share its advantage, averaged over the batch.
                    advantage = (reward - mean) / std / (len(s.tokens) * prompts * group)
                    pad = [0.0] * len(prompt)
                    data.append(Datum.from_sequence(
                        prompt + s.tokens, sampling_logprobs=pad + s.logprobs,
                        advantages=pad + [advantage] * len(s.tokens)))
            if data:
                session.forward_backward(data, "importance_sampling")
                session.optim_step(AdamParams(learning_rate=learning_rate))
                session.save_weights_for_sampler()
            mean_rewards.append(statistics.fmean(rewards))
            print(f"step {step + 1}: reward {mean_rewards[-1]:.3f}")
    return mean_rewards


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", default="127.0.0.1:50051")
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    with opentinker.Client(args.scheduler) as client:
        train(client, args.model)
