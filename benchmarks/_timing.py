"""Measuring peers: alternating, interleaved timing in one process (medians and spreads), and peak RSS."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

from overlap_optim.testing import run_cases, run_ranks


def time_peers(peers: dict[str, Callable[[], None]], warmup: int, repeats: int,
               before: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
    """Run each peer ``warmup`` times, then ``repeats`` rounds in which every peer runs once,
    in turn, so that noise on this shared machine falls on all of them alike. ``before``, if
    given, runs untimed before each timed call (a barrier: a peer then starts with the ranks
    together, whatever the peer before it left behind).

    Returns ``{peer: {"median_s", "p25_s", "p75_s"}}``.
    """
    for _ in range(warmup):
        for fn in peers.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in peers}
    for _ in range(repeats):
        for name, fn in peers.items():
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: _summary(values) for name, values in samples.items()}


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return {"median_s": statistics.median(ordered), "p25_s": quartiles[0], "p75_s": quartiles[2]}


def on_ranks(fn: Callable[..., Any], *args: Any, quick: bool, world_size: int = 2, timeout: float = 240.0) -> list[Any]:
    """``[fn(0, world_size, *args), fn(1, ...), ...]``, as ``run_ranks`` gives it. A full run starts
    fresh processes, so what it measures is the call's own. Quick mode (smoke: its numbers mean
    nothing) runs it in the spawned group that the previous quick call left
    (``overlap_optim.testing.run_cases``), which saves a start of torch and TorchRec per call."""
    if not quick:
        return run_ranks(fn, *args, world_size=world_size, timeout=timeout)
    return run_cases({fn.__name__: fn}, None, *args, world_size=world_size, timeout=timeout)[fn.__name__]


def peak_rss_kib(fn: Callable[..., int], peers: list[str], *args: Any, quick: bool, timeout: float = 600.0) -> dict[str, int]:
    """``{peer: the largest of fn(rank, world_size, peer, *args) over the ranks}``: each rank's peak RSS.

    A peak is a peer's own only in processes that ran nothing else, so the full run starts one
    group of ranks per peer. Quick mode (smoke: its numbers mean nothing) runs the peers in turn
    in one group, which saves a start of torch per peer; the later peers then report the running peak.
    """
    if not quick:
        return {peer: max(run_ranks(fn, peer, *args, timeout=timeout)) for peer in peers}
    by_rank = on_ranks(_each_peer, fn, list(peers), args, quick=True, timeout=timeout)
    return {peer: max(result[peer] for result in by_rank) for peer in peers}


def own_peak_rss_kib() -> int:
    """This process's own peak RSS in KiB: ``VmHWM`` of ``/proc/self/status`` where Linux has it.

    Not ``ru_maxrss``: Linux carries a parent's peak into a child it starts (fork, then exec),
    so every rank spawned by a large benchmark runner reported the runner's peak (6.5 to 9.1 GB
    for every peer alike, ratios 1.00 by construction) until 2026-11-24. ``ru_maxrss`` is the
    fallback where ``/proc`` is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _each_peer(rank: int, world_size: int, fn: Callable[..., int], peers: list[str], args: tuple) -> dict[str, int]:
    return {peer: fn(rank, world_size, peer, *args) for peer in peers}
