"""Argument types the benchmarks share."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (0 rounds, turns or episodes measure nothing at all)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1, got {value}")
    return value
