"""The one name a base model goes by in caches and spare pools."""

from __future__ import annotations

from pathlib import Path


def model_key(base_model: str) -> str:
    """One name per base model: a local folder by its absolute path, a hub id as given."""
    path = Path(base_model)
    return str(path.resolve()) if path.exists() else base_model
