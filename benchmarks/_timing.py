"""Alternating, interleaved timing of peers in one process: medians and spreads."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def time_peers(peers: dict[str, Callable[[], None]], warmup: int, repeats: int) -> dict[str, dict[str, float]]:
    """Run each peer ``warmup`` times, then ``repeats`` rounds in which every peer runs once,
    in turn, so that noise on this shared machine falls on all of them alike.

    Returns ``{peer: {"median_s", "p25_s", "p75_s"}}``.
    """
    for _ in range(warmup):
        for fn in peers.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in peers}
    for _ in range(repeats):
        for name, fn in peers.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: _summary(values) for name, values in samples.items()}


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return {"median_s": statistics.median(ordered), "p25_s": quartiles[0], "p75_s": quartiles[2]}
