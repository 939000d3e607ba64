"""Job processes share the CPU by the worker's slots (devices.cpu_thread_env)."""

from __future__ import annotations

import os

import pytest

from opentinker.services.worker.devices import Device, cpu_thread_env


def cpus(n: int) -> list[Device]:
    return [Device(f"h/cpu:{i}", "cpu") for i in range(n)]


def test_the_cores_are_divided_among_the_cpu_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert cpu_thread_env(cpus(4)) == {"OMP_NUM_THREADS": "4"}  # 16 cores / 4 slots
    assert cpu_thread_env(cpus(1)) == {"OMP_NUM_THREADS": "16"}
    assert cpu_thread_env(cpus(32)) == {"OMP_NUM_THREADS": "1"}  # never 0


def test_gpus_and_an_operators_setting_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_thread_env([Device("h/cuda:0", "cuda")]) == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_thread_env(cpus(2)) == {}
