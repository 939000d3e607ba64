"""Top-k next-token logprobs of a scored sequence (Tinker's topk_prompt_logprobs and
topk_sample_logprobs): the k likeliest tokens at each position, as flat row-major lists."""

from __future__ import annotations

from typing import Any

import torch

from opentinker.errors import InvalidArgumentError
from opentinker.services.rollout.engines.engine import TransformersEngine

MAX_TOP_K = 64  # a row per position and k values each travel back: keep replies bounded


def check_top_k(top_k: int) -> None:
    if not 0 <= top_k <= MAX_TOP_K:
        raise InvalidArgumentError(f"top_k: {top_k} is outside 0..{MAX_TOP_K}")


def top_k_rows(logprobs_T_V: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The k likeliest ids of each of the T rows and their logprobs, likeliest first,
    flattened row-major (T * k each)."""
    values_T_K, ids_T_K = logprobs_T_V.topk(min(k, logprobs_T_V.shape[-1]), dim=-1)
    return ids_T_K.flatten().cpu().tolist(), values_T_K.flatten().cpu().tolist()


def engine_top_logprobs(engine: Any, token_ids: list[int], k: int) -> tuple[list[int], list[float]]:
    """The engine's top-k rows of ``token_ids``: a shared engine's adapter answers itself
    (``top_logprobs_of``), a TransformersEngine with its model here; InvalidArgumentError
    naming top_k otherwise (vLLM engines do not serve it yet)."""
    top = getattr(engine, "top_logprobs_of", None)  # an optional engine capability
    if top is None and isinstance(engine, TransformersEngine) and not engine.role_adapters:
        return transformers_top_logprobs(engine.model, engine.device, token_ids, k)
    if top is None:
        raise InvalidArgumentError(
            f"top_k: top-k logprobs are not served by the {getattr(engine, 'name', '?')} engine "
            "yet (the transformers engines serve them); leave it 0"
        )
    return top(token_ids, k)


@torch.no_grad()
def transformers_top_logprobs(
    model: Any, device: Any, token_ids: list[int], k: int
) -> tuple[list[int], list[float]]:
    """Top-k rows of a transformers causal LM at temperature 1 (T - 1 rows for T ids)."""
    ids_1_T = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    logits_T_V = model(input_ids=ids_1_T).logits[0, :-1].float()
    return top_k_rows(torch.log_softmax(logits_T_V, dim=-1), k)
