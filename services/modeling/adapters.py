"""A LoRA job's starting adapter (``ModelSpec.init_adapter``), loaded the same way by the
trainer's policy and the rollout's engine so that both start from the same weights.

Both wrap the base with ``spec.lora`` (peft ``get_peft_model``), then copy the saved adapter's
tensors in: the tensor names are those of a fresh adapter, which the weight sync relies on.
The saved adapter must therefore have the job's rank, alpha and target modules.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, cast

import peft
import torch
from peft import set_peft_model_state_dict
from peft.utils import load_peft_weights

from opentinker.spec import LoraConfig, ModelSpec

if TYPE_CHECKING:
    from torch.nn.modules.module import _IncompatibleKeys

ADAPTER_CONFIG = "adapter_config.json"


def peft_lora_config(lora: LoraConfig, base_model: str | None = None) -> peft.LoraConfig:
    """The job's LoRA as peft's config: the trainer and every rollout engine wrap their model
    with this one, so the adapters have the same tensor names and the same scaling."""
    return peft.LoraConfig(
        r=lora.rank,
        # peft annotates an int but only divides by it (scaling = alpha / r); ours is a float.
        lora_alpha=lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def load_adapter_weights(
    model: torch.nn.Module,
    folder: Path,
    device: torch.device,
    *,
    adapter_name: str = "default",
) -> _IncompatibleKeys:
    """Copy the adapter peft saved in ``folder`` into ``model``'s adapter ``adapter_name``;
    returns torch's (missing_keys, unexpected_keys) of the copy, as ``load_state_dict`` does."""
    weights = load_peft_weights(str(folder), device=str(device))
    loaded = set_peft_model_state_dict(model, weights, adapter_name=adapter_name)
    # peft annotates its result as a bare ``namedtuple``; it is load_state_dict's.
    return cast("_IncompatibleKeys", loaded)


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
    loaded = load_adapter_weights(model, folder, device, adapter_name=adapter_name)
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
