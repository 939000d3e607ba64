"""Keep Python's cyclic garbage collector off a loaded model's heap.

After torch, transformers and a model are loaded a process holds ~450k objects that the
cyclic collector tracks, and a full collection walks every one of them: 234-287 ms on the
2-core CPU machine, a stall of whatever step triggers it (the rollout and the trainer make
thousands of short-lived objects a step, so one comes every few hundred steps).
``gc.freeze()`` moves every object alive now into a permanent generation the collector never
walks; objects made later are collected as before (bench/shared_prompts.py measures both).
An object frozen that later becomes part of an unreachable cycle is never freed, so only a
process that serves one job freezes (the trainer's and the rollout's job processes, once
their model is loaded; not a server that loads many models, nor a test process); a spare that
serves several jobs freezes only what its imports made (``freeze_imports_once``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import structlog

log = structlog.get_logger(__name__)

Spec = TypeVar("Spec")
Loaded = TypeVar("Loaded")


_imports_frozen = False  # freeze_imports_once ran: a job's own freeze is skipped


def freeze_loaded_heap(after: str) -> None:
    """Freeze what is alive now (``after``: what was just loaded, for the log)."""
    if _imports_frozen:
        return
    gc.freeze()
    log.debug("heap_frozen", after=after, frozen_objects=gc.get_freeze_count())


def freeze_imports_once() -> None:
    """A process that serves several jobs (modeling/spare.py, ``serve_jobs``) freezes what its
    imports made, once, and no job's model: the collector then walks only what the current job
    made, during the job and in the cheap collection at its end that frees its cycles."""
    global _imports_frozen
    gc.collect()
    gc.freeze()
    _imports_frozen = True
    log.debug("heap_frozen", after="imports", frozen_objects=gc.get_freeze_count())


def frozen_after(load: Callable[[Spec], Loaded], what: str) -> Callable[[Spec], Loaded]:
    """``load``, then ``freeze_loaded_heap(what)``: for a job process's model loader."""

    def load_then_freeze(spec: Spec) -> Loaded:
        loaded = load(spec)
        freeze_loaded_heap(what)
        return loaded

    return load_then_freeze
