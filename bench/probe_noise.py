"""How far bfloat16 rounding alone moves the weight-sync probe, against the probe tolerance.

The probe (trainer/rollout_link/weight_sync.py) holds the rollout's logprobs of 32 tokens to the
trainer's within a tolerance per dtype pair (modeling/placement.py). bf16's error is relative
to the logits, so it grows with their spread: a random-init model's logits have std ~0.6, a
trained model's several times that. Trained weights cannot be downloaded here, so the spread
is set by scaling the final norm's weight of a random-init Qwen2 model, which scales every
logit (an RMSNorm feeds the tied head). For each spread it prints the max |Δlogprob| over the
probe between float32 and bf16, and between two bf16 kernels (eager vs sdpa attention, as
vLLM's and transformers' differ), next to the tolerance the sync applies at that spread.

    .venv/bin/python bench/probe_noise.py                 # 0.5B shape, 24 layers (~2 min)
    .venv/bin/python bench/probe_noise.py --layers 4 --scales 1,10
"""

from __future__ import annotations

import argparse

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from opentinker.services.modeling.placement import probe_tolerance
from opentinker.services.modeling.tiny_model import QWEN2_5_0_5B_SHAPE
from opentinker.services.trainer.model.policy import PROBE_LENGTH


def probe(model: Qwen2ForCausalLM, ids_1_L: torch.Tensor, dtype: torch.dtype, attention: str):
    """(logprobs of the probe's tokens, the logits' scale) with the model in ``dtype``."""
    model.config._attn_implementation = attention
    # transformers' @wraps(Module.to) types `to` as a plain function (self not bound)
    model.to(dtype)  # type: ignore[arg-type]
    with torch.no_grad():
        logits_T_V = model(input_ids=ids_1_L).logits.float()[0, :-1]
    logprobs_T = torch.log_softmax(logits_T_V, -1).gather(-1, ids_1_L[0, 1:, None])[:, 0]
    return logprobs_T, logits_T_V.std(dim=-1).square().mean().sqrt().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=QWEN2_5_0_5B_SHAPE["num_layers"])
    parser.add_argument("--scales", default="1,4,10,20", help="final-norm weight multipliers")
    args = parser.parse_args()
    shape = QWEN2_5_0_5B_SHAPE
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=args.layers,
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).eval()
    ids_1_L = torch.randint(0, shape["vocab_size"], (1, PROBE_LENGTH))
    norm = model.model.norm.weight.detach().clone()
    print(f"Qwen2.5-0.5B shape, {args.layers} layers, random init; probe of {PROBE_LENGTH} tokens")
    print(
        f"{'norm x':>7} {'logit std':>9} {'fp32-bf16':>9} {'bf16 kernels':>12} "
        f"{'worst/std':>9} {'tolerance':>9} {'fixed 5e-2':>10}"
    )
    for scale in (float(s) for s in args.scales.split(",")):
        model.to(torch.float32)
        model.model.norm.weight.data = norm * scale
        exact, logit_std = probe(model, ids_1_L, torch.float32, "eager")
        bf16_eager, _ = probe(model, ids_1_L, torch.bfloat16, "eager")
        bf16_sdpa, _ = probe(model, ids_1_L, torch.bfloat16, "sdpa")
        one_side = (exact - bf16_eager).abs().max().item()
        kernels = (bf16_eager - bf16_sdpa).abs().max().item()
        worst = max(one_side, kernels)
        tolerance = probe_tolerance(torch.bfloat16, torch.bfloat16, logit_std)
        verdict = "passes" if worst <= 5e-2 else "FAILS"
        print(
            f"{scale:>7g} {logit_std:>9.2f} {one_side:>9.4f} {kernels:>12.4f} "
            f"{worst / logit_std:>9.3f} {tolerance:>9.3f} {verdict:>10}"
            + ("" if worst <= tolerance else "   over the tolerance")
        )


if __name__ == "__main__":
    main()
