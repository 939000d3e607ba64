"""Where a job's model lives and in which dtype: one rule, read from the job's lease, used by
both the trainer and the rollout so the two always agree.

The rule (what verl/OpenRLHF users expect):

- a lease of CUDA devices: ``cuda:0`` (the worker sets CUDA_VISIBLE_DEVICES to the leased
  GPUs, so the first leased GPU is ``cuda:0`` inside the job's processes), bfloat16;
- a lease of CPU slots (or no lease: a process started by hand): ``cpu``, float32.

A device named in settings (``OPENTINKER_TRAINER_DEVICE``/``OPENTINKER_ROLLOUT_DEVICE``)
overrides the device; the dtype always follows the device, so an override on one side only
still picks the dtype the rule gives for that device.

The weight-sync probe compares the rollout's logprobs with the trainer's; how close they can
be depends on the two dtypes, so the tolerance is a documented table per pair
(``probe_tolerance``), not one number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from opentinker.errors import ConfigError


@dataclass(frozen=True)
class Placement:
    """device: a torch device string ("cpu", "cuda:0"); dtype: the weights' and compute dtype;
    num_devices: how many devices the lease holds (one trainer rank each)."""

    device: str
    dtype: torch.dtype
    num_devices: int = 1

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


def dtype_for_device(device: str) -> torch.dtype:
    """bfloat16 on CUDA, float32 anywhere else (CPU bf16 matmuls are slow and lossy)."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def placement_for_lease(
    device_ids: Sequence[str], *, cuda_available: bool, override: str = ""
) -> Placement:
    """The placement for leased ``device_ids`` ("host/cuda:3", "host/cpu:0", ...).

    Raises ConfigError for a lease mixing CUDA and CPU devices, or a CUDA lease on a process
    that sees no CUDA device (CUDA_VISIBLE_DEVICES wrong, or a CPU-only torch).
    """
    kinds = {_kind(device_id) for device_id in device_ids}
    if len(kinds) > 1:
        raise ConfigError(
            f"the lease mixes device kinds {sorted(kinds)} ({list(device_ids)}); "
            f"a job runs on CUDA devices or on CPU slots, not both",
            reason="MIXED_DEVICE_LEASE",
        )
    leased_cuda = kinds == {"cuda"}
    if leased_cuda and not cuda_available:
        raise ConfigError(
            f"the lease holds CUDA devices {list(device_ids)} but this process sees none; "
            f"check CUDA_VISIBLE_DEVICES and that torch is built with CUDA",
            reason="CUDA_UNAVAILABLE",
        )
    device = override or ("cuda:0" if leased_cuda else "cpu")
    return Placement(device, dtype_for_device(device), max(len(device_ids), 1))


def placement_here(device_ids: Sequence[str], *, override: str = "") -> Placement:
    """``placement_for_lease`` for this process (asks torch whether CUDA is visible)."""
    return placement_for_lease(
        device_ids, cuda_available=torch.cuda.is_available(), override=override
    )


def _kind(device_id: str) -> str:
    """ "host/cuda:3" -> "cuda"; "host/cpu:0" -> "cpu"."""
    return device_id.rsplit("/", 1)[-1].split(":", 1)[0]


@dataclass(frozen=True)
class ProbeTolerance:
    """Largest |Δlogprob| on the probe still counted as "the rollout serves the trainer's
    weights": ``floor``, or ``per_logit_std`` times the probe's logit scale if larger."""

    floor: float
    per_logit_std: float

    def at(self, logit_scale: float) -> float:
        return max(self.floor, self.per_logit_std * logit_scale)


# Per (trainer dtype, rollout dtype). Same weights in float32 on both sides agree to ~1e-6
# (kernels sum in different orders). In a narrower dtype the logits carry a relative error
# (bfloat16 keeps 8 bits of mantissa), so |Δlogprob| grows with the logits' spread: max |Δ|
# over the 32 probe tokens was 0.05-0.07 x the logits' std (bench/probe_noise.py: bf16 vs
# float32 and bf16 eager vs sdpa attention on CPU, logit std 0.6 to 12; vLLM vs transformers
# on an H100 at std ~0.6: 0.043). A random-init model's logits have std ~0.6, a trained
# one's several times that, where a fixed 5e-2 would fail every sync. A stale or wrong
# weight moves the probe by far more than the noise; an update that moves it less is what
# ProbeShiftWatch (trainer/rollout_link/weight_sync.py) reports.
PROBE_TOLERANCE: dict[tuple[torch.dtype, torch.dtype], ProbeTolerance] = {
    (torch.float32, torch.float32): ProbeTolerance(1e-3, 0.0),
    (torch.float32, torch.bfloat16): ProbeTolerance(5e-2, 0.2),
    (torch.bfloat16, torch.float32): ProbeTolerance(5e-2, 0.2),
    (torch.bfloat16, torch.bfloat16): ProbeTolerance(5e-2, 0.2),
    (torch.float16, torch.float16): ProbeTolerance(1e-2, 0.03),
}


def probe_tolerance(
    trainer_dtype: torch.dtype, rollout_dtype: torch.dtype, logit_scale: float = 0.0
) -> float:
    """The documented probe tolerance for the pair at the probe's ``logit_scale`` (the RMS
    over its positions of the logits' std over the vocabulary; 0: the floor alone);
    ConfigError for a pair not in the table."""
    try:
        return PROBE_TOLERANCE[(trainer_dtype, rollout_dtype)].at(logit_scale)
    except KeyError:
        raise ConfigError(
            f"no weight-sync probe tolerance for trainer {trainer_dtype} / rollout "
            f"{rollout_dtype}; set OPENTINKER_TRAINER_PROBE_TOLERANCE explicitly",
            reason="UNKNOWN_DTYPE_PAIR",
        ) from None
