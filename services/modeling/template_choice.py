"""The chat template a job chose (``ModelSpec.chat_template``; ``opentinker.chat_templates``),
put on the tokenizer each of its processes loads, so that every renderer (the rollout's chat
format, the trainer's SFT data) uses the same one. Nothing is chosen silently: with no choice
the tokenizer keeps its own template, or none, and whatever needs one refuses, naming the
field."""

from __future__ import annotations

from typing import Any

import structlog

from opentinker.chat_templates import chat_template_text

log = structlog.get_logger(__name__)

NO_TEMPLATE_HINT = (
    "set model.chat_template to 'plain' (a simple documented format: `Role: content` turns, "
    "eos after each assistant turn) or to a Jinja template, or have an admin register the model "
    "with `opentinker models register NAME --chat-template plain`"
)


_OWN = "opentinker_own_chat_template"  # the template the tokenizer was loaded with


def use_chat_template(tokenizer: Any, choice: str) -> None:
    """Give ``tokenizer`` (a transformers tokenizer) the template ``choice`` names; ``""``
    gives it back the one it was loaded with (a process that serves one job after another
    with one loaded tokenizer must not pass a job's choice on to the next)."""
    if not hasattr(tokenizer, _OWN):
        setattr(tokenizer, _OWN, getattr(tokenizer, "chat_template", None))
    text = chat_template_text(choice)
    tokenizer.chat_template = getattr(tokenizer, _OWN) if text is None else text
    if text is not None:
        log.info("chat_template_chosen", choice=choice if len(choice) < 40 else "jinja")
