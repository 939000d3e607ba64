"""Which curves a job's charts show (the PNG of ``opentinker plot`` and the dashboard's job
page): one panel per figure, the step-time split as stacked parts of each step."""

from __future__ import annotations

# (title, metric names drawn on it); a panel whose metrics never appear is left out.
PANELS: list[tuple[str, list[str]]] = [
    ("reward", ["reward_mean"]),
    ("loss", ["loss", "train/loss", "val/loss"]),
    ("entropy", ["entropy"]),
    ("KL to the reference", ["kl"]),
    ("environment", ["env_reward_mean", "env_win_rate", "env_turns_mean"]),
]
STEP_TIME_PARTS = [
    "time_generate_s",
    "time_env_s",
    "time_train_s",
    "time_weight_sync_s",
    "time_mesh_s",
]
