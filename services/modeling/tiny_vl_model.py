"""Build a tiny Qwen2-VL-architecture model (vision tower + Qwen2 text model) with a local
processor, saved like a real one (``save_pretrained``; loaded back with ``from_pretrained``).

Nothing is downloaded: the tokenizer is ``tiny_model``'s byte-level BPE plus Qwen2-VL's vision
special tokens; the image processor is Qwen2-VL's (its PIL variant: no torchvision needed),
limited to small images (a 112x112 figure is 16 image tokens); the weights are random. The
folder holds the tokenizer and the image processor side by side (what ``rollout.multimodal``
loads), as a real Qwen2-VL checkpoint does.

    python -m opentinker.services.modeling.tiny_vl_model --out runs/tiny-qwen2-vl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import (
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    set_seed,
)

from opentinker.services.modeling.tiny_model import build_tokenizer

VERSION = 1
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH_SIZE, MERGE_SIZE = 14, 2
MAX_PIXELS = 224 * 224

# ChatML with image parts (Qwen2-VL's layout) and Hermes-style tools in a system turn.
VL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    '{% endfor %}Call a tool as <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_vl_model(out_dir: Path, *, hidden_size: int = 64, seed: int = 0) -> Path:
    """Save a random-init Qwen2-VL model and its processor to ``out_dir``; return the folder."""
    out_dir = Path(out_dir)
    set_seed(seed)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    ids: dict[str, int] = {}
    for token in VISION_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        assert isinstance(token_id, int)  # one token, one id (a list only for a list)
        ids[token] = token_id
    heads = 4
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": hidden_size * 4,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "tie_word_embeddings": True,
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": hidden_size,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        min_pixels=56 * 56,
        max_pixels=MAX_PIXELS,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    image_processor.save_pretrained(out_dir)
    (out_dir / "opentinker_tiny.json").write_text(json.dumps({"seed": seed, "version": VERSION}))
    return out_dir


def ensure_tiny_vl_model(out_dir: Path, **kwargs) -> Path:
    """Build the tiny VL model once; later calls reuse the saved folder."""
    out_dir = Path(out_dir)
    stamp = out_dir / "opentinker_tiny.json"
    if not stamp.exists() or json.loads(stamp.read_text()).get("version") != VERSION:
        build_tiny_vl_model(out_dir, **kwargs)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the tiny local Qwen2-VL model.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build_tiny_vl_model(args.out, seed=args.seed)


if __name__ == "__main__":
    main()
