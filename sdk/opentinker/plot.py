"""``opentinker plot``: a job's curves as a PNG, drawn with matplotlib (the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path

from opentinker.charts import PANELS, STEP_TIME_PARTS
from opentinker.errors import ConfigError
from opentinker.jobs import JobEvent


def plot_curves(steps: list[JobEvent], path: Path, *, title: str) -> Path:
    """Draw reward, loss, entropy, KL and the step-time split against the step; one panel
    per figure the steps carry. ConfigError when there is no step to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ConfigError("plot needs matplotlib: pip install 'opentinker[plot]'") from err
    if not steps:
        raise ConfigError("the job has reported no step yet: nothing to plot")
    seen = {name for e in steps for name in e.metrics}
    panels = [(t, [n for n in names if n in seen]) for t, names in PANELS]
    panels = [(t, names) for t, names in panels if names]
    parts = [n for n in STEP_TIME_PARTS if n in seen]
    count = len(panels) + (1 if parts else 0)
    fig, axes = plt.subplots(count, 1, figsize=(8, 2.4 * count), sharex=True, squeeze=False)
    for ax, (panel_title, names) in zip(axes[:, 0], panels, strict=False):
        for name in names:
            points = [(e.step, e.metrics[name]) for e in steps if name in e.metrics]
            ax.plot(*zip(*points, strict=True), label=name)
        ax.set_title(panel_title)
        ax.legend(loc="best", fontsize="small")
    if parts:
        ax = axes[-1, 0]
        xs = [e.step for e in steps]
        ax.stackplot(xs, *[[e.metrics.get(n, 0.0) for e in steps] for n in parts], labels=parts)
        ax.set_title("step time split (s)")
        ax.legend(loc="upper left", fontsize="small")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
