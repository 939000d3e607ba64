"""A LoRA job's starting adapter (``ModelSpec.init_adapter``), loaded the same way by the
trainer's policy and the rollout's engine so that both start from the same weights.

Both wrap the base with ``spec.lora`` (peft ``get_peft_model``), then copy the saved adapter's
tensors in: the tensor names are those of a fresh adapter, which the weight sync relies on.
The saved adapter must therefore have the job's rank, alpha and target modules.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import set_peft_model_state_dict
from peft.utils import load_peft_weights

from opentinker.spec import ModelSpec

ADAPTER_CONFIG = "adapter_config.json"


def load_init_adapter(
    model: torch.nn.Module,
    spec: ModelSpec,
    device: torch.device,
    *,
    adapter_name: str = "default",
) -> None:
    """Copy ``spec.init_adapter``'s weights into ``model`` (a PeftModel wrapped with
    ``spec.lora``) as its adapter ``adapter_name`` (a shared engine names one per job).
    Raises ValueError naming the folder and what does not fit."""
    if spec.init_adapter is None:
        return
    folder = Path(spec.init_adapter)
    saved = _saved_config(folder)
    lora = spec.lora
    modules = saved.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    fits = (
        saved.get("r") == lora.rank
        and float(saved.get("lora_alpha", 0)) == lora.alpha
        and sorted(modules) == sorted(lora.target_modules)
    )
    if not fits:
        raise ValueError(
            f"init_adapter {folder}: saved with rank {saved.get('r')}, alpha "
            f"{saved.get('lora_alpha')}, target modules {sorted(modules)}; the job's model.lora "
            f"has rank {lora.rank}, alpha {lora.alpha}, target modules "
            f"{sorted(lora.target_modules)}; make them equal"
        )
    weights = load_peft_weights(str(folder), device=str(device))
    loaded = set_peft_model_state_dict(model, weights, adapter_name=adapter_name)
    missing = [k for k in loaded.missing_keys if "lora_" in k and f".{adapter_name}." in k]
    if loaded.unexpected_keys or missing:
        raise ValueError(
            f"init_adapter {folder} does not fit the model: missing {missing[:3]}, "
            f"unexpected {list(loaded.unexpected_keys)[:3]}"
        )


def _saved_config(folder: Path) -> dict:
    try:
        return json.loads((folder / ADAPTER_CONFIG).read_text())
    except FileNotFoundError as err:
        raise ValueError(
            f"init_adapter {folder}: no {ADAPTER_CONFIG} there (not a saved PEFT adapter "
            f"on this node)"
        ) from err
    except json.JSONDecodeError as err:
        raise ValueError(f"init_adapter {folder}: unreadable {ADAPTER_CONFIG}: {err}") from err
