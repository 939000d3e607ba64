"""How the CLI shows jobs and their events to a person (rich tables and lines)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from opentinker.jobs import JobEvent, JobInfo
from opentinker.scheduler.v1 import scheduler_pb2

STATE_STYLE = {
    "QUEUED": "yellow",
    "ALLOCATING": "yellow",
    "RUNNING": "cyan",
    "SUCCEEDED": "green",
    "FAILED": "red",
    "CANCELLED": "magenta",
}

# Step metrics shown on each line, in this order, with their format.
STEP_COLUMNS = [
    ("reward_mean", "reward {:.3f}"),
    ("loss", "loss {:+.4f}"),
    ("entropy", "entropy {:.2f}"),
    ("train/loss", "train loss {:.4f}"),  # SFT
    ("val/loss", "val loss {:.4f}"),  # SFT, on eval steps
    ("tokens_per_s", "{:.0f} tok/s"),
    ("time_generate_s", "gen {:.2f}s"),
    ("time_env_s", "env {:.2f}s"),
    ("time_train_s", "train {:.2f}s"),
    ("time_weight_sync_s", "sync {:.2f}s"),
    ("time_mesh_s", "mesh {:.2f}s"),
    ("memory_allocated_peak_gib", "gpu mem {:.1f} GiB"),  # the trainer's peak, on a GPU
]


JOB_HEADERS = ("job", "name", "state", "kind", "att.", "budget", "reward", "created", "reason")
DROP_WHEN_NARROW = ("created", "kind", "budget", "att.")  # the first goes first


def jobs_table(jobs: list[JobInfo], *, width: int = 120) -> Table:
    """One line per job that fits a terminal ``width`` characters wide: ids, states and
    figures keep their width (less useful columns go when it is narrow); the name and the
    reason/checkpoint shrink with an ellipsis."""
    rows = [dict(zip(JOB_HEADERS, _job_row(job), strict=True)) for job in jobs]
    widths = {h: max([len(h)] + [len(Text.from_markup(r[h]).plain) for r in rows])
              for h in JOB_HEADERS}  # fmt: skip
    widths["name"] = min(widths["name"], 24)
    shown = list(JOB_HEADERS)

    def room_for_reason() -> int:  # "│ " before each cell, " " after, a closing "│"
        return width - (3 * len(shown) + 1) - sum(widths[h] for h in shown if h != "reason")

    for header in DROP_WHEN_NARROW:
        if room_for_reason() >= 12:
            break
        shown.remove(header)
    widths["reason"] = max(8, room_for_reason())
    table = Table(title="jobs")
    for header in shown:
        justify: JustifyMethod = "right" if header in ("att.", "budget", "reward") else "left"
        table.add_column(
            header, justify=justify, no_wrap=True, overflow="ellipsis", max_width=widths[header]
        )
    for row in rows:
        table.add_row(*(row[h] for h in shown))
    return table


def _job_row(job: JobInfo) -> list[str]:
    created = dt.datetime.fromtimestamp(job.created_unix_s).strftime("%m-%d %H:%M")
    reward = job.final_reward
    return [
        job.job_id,
        job.name,
        f"[{STATE_STYLE.get(job.state, '')}]{job.state}[/]",
        job.kind.lower(),
        str(job.attempt),
        str(job.step_budget or "—"),
        "—" if reward is None else f"{reward:.3f}",
        created,
        job.checkpoint_uri if job.state == "SUCCEEDED" else job.reason,
    ]


def format_event(event: JobEvent) -> str:
    """One line for a person: a state change, a step's metrics, or a log message."""
    if event.kind == "state":
        style = STATE_STYLE.get(event.state, "")
        reason = f" — {event.reason}" if event.reason else ""
        return f"[{style}]● {event.state}[/]{reason}"
    if event.kind == "step":
        parts = [f"step {event.step:>5}", f"v{event.policy_version}"]
        parts += [
            fmt.format(event.metrics[key]) for key, fmt in STEP_COLUMNS if key in event.metrics
        ]
        if errors := event.metrics.get("env_errors"):
            share = event.metrics.get("env_error_frac", 0.0)
            first = f" first: {escape(event.env_error_reason)}" if event.env_error_reason else ""
            parts.append(f"[red]env errors {errors:.0f} ({share:.0%})[/]{first}")
        return "  ".join(parts)
    if event.kind == "row":
        r = event.row
        return f"episode {r.get('index')}: reward {r.get('reward')} ({r.get('finish_reason')})"
    return f"[dim]{event.message}[/]"


def print_event(console: Console, event: JobEvent, *, every: int = 1) -> None:
    """Print state changes and logs always, step lines every ``every`` steps."""
    if event.kind == "step" and every > 1 and event.step % every != 0:
        return
    console.print(format_event(event), highlight=False)


def event_printer(*, every: int = 1, console: Console | None = None) -> Callable[[JobEvent], None]:
    """An ``on_event`` for ``Client.fit``/``infer`` that prints as ``opentinker tail`` does:
    state changes, logs (env errors with their first reason among them) and every
    ``every``-th step line (its env errors in red)::

        client.fit(spec, on_event=event_printer(every=5))
    """
    out = console or Console()

    def on_event(event: JobEvent) -> None:
        print_event(out, event, every=every)

    return on_event


def usage_table(tenant: scheduler_pb2.TenantUsage) -> Table:
    """One tenant's usage: the period and total lines, then a line per job."""
    q = tenant.quota
    start = dt.datetime.fromtimestamp(tenant.period_start_unix_s, dt.UTC).strftime("%Y-%m-%d %H:%M")
    budget = f" of {q.device_seconds_per_period:,.0f}" if q.device_seconds_per_period else ""
    devices = (
        f"{tenant.devices_in_use} of {q.max_devices}" if q.max_devices else tenant.devices_in_use
    )
    table = Table(
        "", "device-s", "tokens gen.", "tokens trained", "steps",
        title=f"tenant {tenant.tenant_id}: devices in use {devices}; "
        f"period from {start} UTC: {tenant.period.device_seconds:,.0f}{budget} device-s",
    )  # fmt: skip
    rows = [("this period", tenant.period), ("total", tenant.total)]
    rows += [(f"{j.job_id} {j.name}", j.usage) for j in tenant.jobs]
    for label, u in rows:
        table.add_row(
            label,
            f"{u.device_seconds:,.1f}",
            f"{u.tokens_generated:,.0f}",
            f"{u.tokens_trained:,.0f}",
            f"{u.steps:,.0f}",
        )
    return table
