"""Which chat template a job's model uses: its tokenizer's own, or one named here.

A base model often ships no chat template (Gemma 3 270M base does not); the rollout, the
trainer and the SFT data then have no way to turn turns into tokens, and refuse the model. A
job chooses a template explicitly instead, never silently: ``ModelSpec.chat_template`` (or the
model's catalog entry, ``opentinker models register --chat-template``) is

- ``""`` (the default): the tokenizer's own template; a tokenizer without one is refused;
- ``"plain"``: :data:`PLAIN_CHAT_TEMPLATE` below, the simplest format a base model continues;
- a Jinja template (text holding ``{{`` or ``{%``): used as it is.

The plain template renders each message as ``Role: content`` (System, User, Assistant, Tool)
with a blank line between messages, the tokenizer's bos token first (when it has one), the
eos token right after each assistant message (a turn ends there, as the rollout requires), and
``Assistant:`` as the generation prompt. It does not render tools: an env's tools are then told
to the model in its own prompt text, or not at all.
"""

from __future__ import annotations

PLAIN = "plain"

PLAIN_CHAT_TEMPLATE = (
    "{%- if bos_token %}{{ bos_token }}{% endif -%}"
    "{%- for message in messages -%}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}"
    "{%- if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}Assistant:{% endif -%}"
)


def check_chat_template_choice(choice: str) -> str:
    """``choice`` as given when it is one of the three forms above; ValueError saying which
    forms there are otherwise."""
    if choice in ("", PLAIN) or "{{" in choice or "{%" in choice:
        return choice
    raise ValueError(
        f"{choice[:40]!r} is neither 'plain' nor a Jinja chat template (text with '{{{{' or "
        "'{%'); leave it empty for the tokenizer's own template"
    )


def chat_template_text(choice: str) -> str | None:
    """The Jinja text of a choice; None for ``""`` (the tokenizer's own)."""
    check_chat_template_choice(choice)
    if not choice:
        return None
    return PLAIN_CHAT_TEMPLATE if choice == PLAIN else choice
