"""Metric sinks: where a client writes a job's step metrics as it watches the job.

    sinks = [JsonlSink("run.jsonl"), TensorBoardSink("tb/"), WandbSink(project="letters")]
    client.fit(spec, sinks=sinks)       # or: opentinker tail JOB --jsonl F --tensorboard DIR

Each sink takes the job's ``JobEvent``s in order (``write``) and is closed once the watch ends.
Step events become scalars named after their metric (``reward_mean``, ``loss``, ``time_*_s``
in seconds) at the event's ``step``; state changes are kept by the jsonl sink only.
TensorBoard and W&B are optional packages, imported when such a sink is made: the SDK itself
needs neither (extras ``tensorboard`` and ``wandb``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import IO, Any, Protocol

from opentinker.errors import ConfigError
from opentinker.jobs import JobEvent


class MetricSink(Protocol):
    """Something that records a job's events; ``close`` flushes and releases it."""

    def write(self, event: JobEvent) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per event (every kind), appended to ``path``; always available."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self.path.open("a", encoding="utf-8")

    def write(self, event: JobEvent) -> None:
        self._file.write(json.dumps(dataclasses.asdict(event), sort_keys=True) + "\n")
        self._file.flush()  # a reader (plot, a person with tail -f) sees each step as it lands

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """TensorBoard event files in ``log_dir`` (one scalar per step metric), written with
    TensorBoard's own event-file writer; needs the ``tensorboard`` extra."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from tensorboard.compat.proto import summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as err:
            raise ConfigError(
                "the TensorBoard sink needs the tensorboard package: "
                "pip install 'opentinker[tensorboard]'"
            ) from err
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._summary_pb2 = summary_pb2
        self._writer = EventFileWriter(str(self.log_dir))

    def write(self, event: JobEvent) -> None:
        if event.kind != "step":
            return
        from tensorboard.compat.proto import event_pb2

        values = [
            self._summary_pb2.Summary.Value(tag=name, simple_value=float(value))
            for name, value in sorted(event.metrics.items())
        ]
        self._writer.add_event(
            event_pb2.Event(
                wall_time=event.time_unix_s or time.time(),
                step=event.step,
                summary=self._summary_pb2.Summary(value=values),
            )
        )

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run in offline mode under ``directory`` (sync it later with
    ``wandb sync``); needs the ``wandb`` extra. No account or network is used."""

    def __init__(
        self,
        *,
        project: str = "opentinker",
        name: str | None = None,
        directory: str | Path = ".",
        config: dict[str, Any] | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ConfigError(
                "the W&B sink needs the wandb package: pip install 'opentinker[wandb]'"
            ) from err
        os.environ.setdefault("WANDB_SILENT", "true")
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project,
            name=name,
            dir=str(directory),
            mode="offline",
            config=config or {},
            reinit="create_new",
        )

    @property
    def run_dir(self) -> Path:
        """The offline run's folder (``.../wandb/offline-run-…``), what ``wandb sync`` takes."""
        return Path(self._run.dir).parent

    def write(self, event: JobEvent) -> None:
        if event.kind == "step":
            self._run.log(dict(event.metrics), step=event.step)

    def close(self) -> None:
        self._run.finish()


def write_all(sinks: list[MetricSink], event: JobEvent) -> None:
    for sink in sinks:
        sink.write(event)


def close_all(sinks: list[MetricSink]) -> None:
    """Close every sink, even when one fails to (the first failure is raised after)."""
    failure: BaseException | None = None
    for sink in sinks:
        try:
            sink.close()
        except Exception as err:  # noqa: BLE001 — close the others, then report
            failure = failure or err
    if failure is not None:
        raise failure
