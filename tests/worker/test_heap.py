"""services/common/heap.py: what is loaded leaves the collector's walks; new garbage does not."""

from __future__ import annotations

import gc

import pytest

from opentinker.services.common.heap import frozen_after

pytestmark = pytest.mark.unit


def test_freezing_keeps_loaded_objects_out_and_still_collects_new_cycles() -> None:
    loaded = [{"weights": [i]} for i in range(1000)]  # stands for a loaded model's objects
    before = gc.get_freeze_count()
    try:
        load = frozen_after(lambda n: [{"weights": [i]} for i in range(n)], "test objects")
        assert len(load(10)) == 10  # the loader's own result
        assert gc.get_freeze_count() >= before + len(loaded)
        cycle: list = []
        cycle.append(cycle)  # garbage made after the freeze: a cycle only gc can free
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()  # the test process goes on collecting as before
    assert gc.get_freeze_count() == 0
