"""The blank model card a saved adapter's README.md starts from, rendered once per process.

peft's ``save_pretrained`` renders huggingface_hub's model-card template (a Jinja compile:
0.15 s of CPU on the 2-core machine, more than the adapter's own tensors take) on every save,
unless the folder holds a README.md already, which it then loads and fills in the same way. A
trainer that saves many checkpoints (a spare reused for short jobs saves one per job) writes
that same rendering, made once, into the folder first: the card peft saves is the same.
"""

from __future__ import annotations

import functools
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

CARD = "README.md"


@functools.cache
def blank_card() -> str:
    """What ``ModelCard.from_template(ModelCardData())`` renders (peft's starting card)."""
    return str(ModelCard.from_template(ModelCardData()))


def write_blank_card(folder: Path) -> None:
    """Put the blank card in ``folder`` (created if missing) for peft to fill in."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CARD).write_text(blank_card())
