"""GGUF files the tests write themselves (no 98 MB download): a tiny random Llama with the
locally trained byte-level BPE tokenizer and its ChatML template, laid out as llama.cpp's
converter lays out a Hugging Face Llama (its tensor names, Q and K rows permuted for its RoPE),
in float32 or with its matrices quantized."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, set_seed

from opentinker.services.modeling.tiny_model import CHAT_TEMPLATE, build_tokenizer

HEADS, KV_HEADS, HIDDEN, LAYERS, FFN = 4, 2, 64, 2, 128


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of the Q/K rows (its rotary pairs); transformers undoes it on load."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tiny_llama(seed: int = 0, *, tied: bool = False) -> LlamaForCausalLM:
    """tied: the LM head is the embedding (as SmolLM2's: its GGUF has no output.weight)."""
    set_seed(seed)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced one shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def write_llama_gguf(
    path: Path,
    model: LlamaForCausalLM,
    *,
    quantize: str | None = None,
    arch: str = "llama",
    eos: str = "<|im_end|>",
) -> Path:
    """Write ``model`` and the local tokenizer as a GGUF; ``quantize``: a GGML type name
    (e.g. "Q8_0") for the 2-D weights; ``eos``: the token the file names as eos (Gemma 3's
    names its end of text while its template ends turns with another)."""
    tokenizer = build_tokenizer()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(model.config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    _add_tokenizer(writer, tokenizer, eos)
    for name, weight in _gguf_tensors(model).items():
        if quantize and weight.ndim == 2:
            kind = gguf.GGMLQuantizationType[quantize]
            writer.add_tensor(name, gguf.quants.quantize(weight, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer, eos: str) -> None:  # noqa: ANN001
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = set(tokenizer.all_special_tokens) | {"<|im_start|>", "<|im_end|>"}
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_eos_token_id(vocab[eos])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _gguf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
    }
    if not model.config.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    for i in range(LAYERS):
        hf = f"model.layers.{i}."
        out |= {
            f"blk.{i}.attn_norm.weight": state[hf + "input_layernorm.weight"],
            f"blk.{i}.attn_q.weight": _permute(state[hf + "self_attn.q_proj.weight"], HEADS),
            f"blk.{i}.attn_k.weight": _permute(state[hf + "self_attn.k_proj.weight"], KV_HEADS),
            f"blk.{i}.attn_v.weight": state[hf + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": state[hf + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_norm.weight": state[hf + "post_attention_layernorm.weight"],
            f"blk.{i}.ffn_gate.weight": state[hf + "mlp.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": state[hf + "mlp.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": state[hf + "mlp.down_proj.weight"],
        }
    return out
