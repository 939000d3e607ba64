"""Build a tiny Qwen2-architecture model with a locally made tokenizer, saved like a real one.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a generated
corpus (512 tokens, ChatML special tokens), the weights are random. Demo and tests load the
result through the same ``from_pretrained`` path a real checkpoint (e.g. Qwen/Qwen2.5-1.5B)
uses.

    python -m opentinker.services.modeling.tiny_model --out runs/tiny-qwen2
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, set_seed

# Bumped whenever the recipe changes, so a cached folder from an older recipe is rebuilt.
VERSION = 2

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen2.5 uses it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Words the built-in environments and chat format use, so common words become single tokens.
_CORPUS_WORDS = (
    "the a an and or of to in is it you your with answer letter single capital number board "
    "move game turn win lose draw reward step python code output error final result boxed frac "
    "sqrt system user assistant please think solve compute value equals sum product what which "
    "where row column player opponent black white empty invalid position play next go take open "
    "close room door key table kitchen apple look inventory north south east west"
).split()


def _training_corpus(seed: int = 0) -> list[str]:
    """Deterministic text to train the BPE merges on: chat markup, env phrases, numbers."""
    rng = random.Random(seed)
    lines = [f"<|im_start|>{role}\n" for role in ("system", "user", "assistant")] * 50
    for _ in range(3000):
        words = " ".join(rng.choice(_CORPUS_WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(words.capitalize() + rng.choice(".?:!"))
    for letter in string.ascii_uppercase:  # every letter alike, so no letter is special
        lines += [
            f"Answer with the letter {letter}.",
            "You answer with a single capital letter.",
        ] * 20
    for _ in range(500):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"What is {a} + {b}? \\boxed{{{a + b}}}")
    return lines


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here on a generated corpus, with ChatML specials.

    Every byte stays encodable (the 256 byte symbols are the initial alphabet), so any text
    round-trips through encode/decode; the merges make the demo's prompts ~3x shorter than
    one token per byte, which is what makes training the tiny model fast on a CPU.
    """
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_training_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


# Qwen2.5-0.5B's shape (its config.json): what a GPU check builds with random init. The vocab
# is padded past the local tokenizer's 512 tokens as Qwen's own is (151,936 rows for 151,665
# tokens), so the LM head costs what the real one does; ids past the tokenizer decode to "".
QWEN2_5_0_5B_SHAPE: dict[str, int] = {
    "hidden_size": 896,
    "num_layers": 24,
    "num_heads": 14,
    "num_kv_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
}
SHAPES: dict[str, dict[str, int]] = {"tiny": {}, "qwen2.5-0.5b": QWEN2_5_0_5B_SHAPE}


def build_tiny_model(
    out_dir: Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int | None = None,
    seed: int = 0,
) -> Path:
    """Save a random-init Qwen2 model and its tokenizer to ``out_dir``; return the folder.

    vocab_size: rows of the embedding and LM head; None = the tokenizer's size (512)."""
    out_dir = Path(out_dir)
    set_seed(seed)
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "opentinker_tiny.json").write_text(json.dumps({"seed": seed, "version": VERSION}))
    return out_dir


def ensure_tiny_model(out_dir: Path, **kwargs) -> Path:
    """Build the tiny model once; later calls reuse the saved folder."""
    out_dir = Path(out_dir)
    stamp = out_dir / "opentinker_tiny.json"
    if not stamp.exists() or json.loads(stamp.read_text()).get("version") != VERSION:
        build_tiny_model(out_dir, **kwargs)
    return out_dir


def ensure_scaled_model(out_dir: Path, *, hidden_size: int, num_layers: int) -> Path:
    """The tiny model's shape at another size (MLP 4 x hidden, as the tiny one's 128 -> 512),
    for benchmarks that measure how a cost moves with the model's compute."""
    return ensure_tiny_model(
        out_dir,
        hidden_size=hidden_size,
        num_layers=num_layers,
        intermediate_size=4 * hidden_size,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the tiny local Qwen2 model.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="tiny", help="qwen2.5-0.5b: 0.49B parameters"
    )
    args = parser.parse_args()
    build_tiny_model(args.out, seed=args.seed, **SHAPES[args.shape])


if __name__ == "__main__":
    main()
