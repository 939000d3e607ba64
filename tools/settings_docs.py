"""Render every service's settings (environment variable, type, default, meaning) as markdown.

The docs' settings reference (`reference/settings.md`) ends with this, appended at build time
by `tools/docs_hooks.py`. Each service reads a pydantic `BaseSettings`; the table comes from
its fields: the variable is the class's `env_prefix` + the field name (or the field's aliases),
the meaning its `description`, or the `#` comment right above the field. Importing the
settings modules needs the `server` extra but never torch.
Run by hand to see it: `.venv/bin/python tools/settings_docs.py`.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys

from pydantic import AliasChoices
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

# (title, module, class): every service's settings, in the order a newcomer meets them.
SETTINGS = [
    ("Scheduler", "opentinker.services.scheduler.settings", "SchedulerSettings"),
    ("Worker agent", "opentinker.services.worker.settings", "WorkerSettings"),
    ("Trainer", "opentinker.services.trainer.settings", "TrainerSettings"),
    ("Rollout", "opentinker.services.rollout.settings", "RolloutSettings"),
    ("EnvHub", "opentinker.services.envhub.settings", "EnvHubSettings"),
    ("Tinker gateway", "opentinker.services.gateway.settings", "GatewaySettings"),
    ("Dashboard", "opentinker.services.dashboard.settings", "DashboardSettings"),
    ("TLS (every service)", "opentinker.services.common.tls", "TlsSettings"),
]


def _comments_above(cls: type) -> dict[str, str]:
    """Field name → the `#` comment lines right above its line in the class body."""
    found: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# "))
        elif m := re.match(r"(\w+)\s*:", stripped):
            found[m.group(1)] = " ".join(pending)
            pending = []
        else:
            pending = []
    return found


def _variables(prefix: str, name: str, info: FieldInfo) -> str:
    alias = info.validation_alias
    if isinstance(alias, str):
        names = [alias]
    elif isinstance(alias, AliasChoices):
        names = [c for c in alias.choices if isinstance(c, str)]
    else:
        names = [f"{prefix}{name}"]
    return ", ".join(f"`{n.upper()}`" for n in names)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "(computed)"
    if info.default is PydanticUndefined:
        return "**required**"
    return f"`{info.default!r}`"


def _type(info: FieldInfo) -> str:
    text = getattr(info.annotation, "__name__", None) or str(info.annotation)
    return text.replace("typing.", "").replace("pathlib.", "").replace("|", "\\|")


def render_class(title: str, cls: type) -> list[str]:
    """A section for one settings class: its docstring, then a row a field."""
    prefix = cls.model_config.get("env_prefix", "")  # type: ignore[attr-defined]  # BaseSettings
    comments = _comments_above(cls)
    out = [f"### {title}", "", (inspect.getdoc(cls) or "").split("\n\n")[0], ""]
    out += ["| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, info in cls.model_fields.items():  # type: ignore[attr-defined]  # BaseSettings
        meaning = (info.description or comments.get(name, "")).replace("|", "\\|")
        meaning = meaning.replace("\n", " ")
        out.append(
            f"| {_variables(prefix, name, info)} | {_type(info)} | {_default(info)} | {meaning} |"
        )
    return [*out, ""]


def render() -> str:
    """Every service's settings table."""
    out = [
        "## Every setting",
        "",
        "Generated from each service's pydantic settings (`tools/settings_docs.py`).",
        "",
    ]
    for title, module, name in SETTINGS:
        out += render_class(title, getattr(importlib.import_module(module), name))
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
