"""How the step cost grows: with the table size at a fixed batch, and with the batch.

Our sharded path on a world of one (one table, dim 64, pooling 20, uniform ids),
fused (row-wise Adagrad) and fallback (Adam). Cost should follow the touched
rows: flat in the table size, roughly linear in the batch. Plotted to PNG.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from benchmarks._sharded import batch, sharded_step
from benchmarks._plots import finish_axes, saved
from benchmarks._timing import time_peers

KERNELS = {"fused (row-wise Adagrad)": (RowWiseAdagrad, {"lr": 0.01}), "fallback (Adam)": (torch.optim.Adam, {"lr": 0.01})}
POOLING = 20


def _median(rows: int, bags: int, kernel: str, warmup: int, repeats: int) -> float:
    cls, kwargs = KERNELS[kernel]
    batches = [batch(rows, bags, POOLING, seed) for seed in range(4)]
    return time_peers({kernel: sharded_step(rows, batches, cls, kwargs)}, warmup, repeats)[kernel]["median_s"]


def run(quick: bool, out: Path | None = None) -> dict:
    """Measure (and plot into ``out``); returns a JSON-able result with ratios."""
    sizes = [2_000, 20_000, 80_000] if quick else [100_000, 1_000_000, 4_000_000]
    batches = [32, 128, 512] if quick else [512, 2048, 8192]
    fixed_rows, fixed_batch = sizes[1], batches[1]
    warmup, repeats = (1, 2) if quick else (2, 8)
    by_rows = {k: {n: _median(n, fixed_batch, k, warmup, repeats) for n in sizes} for k in KERNELS}
    by_batch = {k: {b: _median(fixed_rows, b, k, warmup, repeats) for b in batches} for k in KERNELS}
    ratios = {}
    for kernel in KERNELS:
        ratios[f"{kernel}: step at {sizes[-1]:,} rows / at {sizes[0]:,} (flat = 1)"] = (
            by_rows[kernel][sizes[-1]] / by_rows[kernel][sizes[0]])
        ratios[f"{kernel}: step at batch {batches[-1]} / at {batches[0]} (linear = {batches[-1] // batches[0]})"] = (
            by_batch[kernel][batches[-1]] / by_batch[kernel][batches[0]])
    plots = _plot(by_rows, by_batch, fixed_rows, fixed_batch, out) if out is not None else []
    return {
        "setup": {"dim": 64, "pooling": POOLING, "fixed_batch": fixed_batch, "fixed_rows": fixed_rows,
                  "repeats": repeats},
        "by_rows_s": {k: {str(n): t for n, t in v.items()} for k, v in by_rows.items()},
        "by_batch_s": {k: {str(b): t for b, t in v.items()} for k, v in by_batch.items()},
        "ratios": ratios,
        "plots": plots,
    }


def _plot(by_rows: dict, by_batch: dict, fixed_rows: int, fixed_batch: int, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kernel, style in zip(KERNELS, ("o-", "s--")):
        left.plot(list(by_rows[kernel]), [t * 1e3 for t in by_rows[kernel].values()], style, label=kernel)
        right.plot(list(by_batch[kernel]), [t * 1e3 for t in by_batch[kernel].values()], style, label=kernel)
    left.set(xscale="log", xlabel="table rows", ylabel="median step (ms)", title=f"table size (batch {fixed_batch})")
    right.set(xscale="log", yscale="log", xlabel="batch size", ylabel="median step (ms)",
              title=f"batch size ({fixed_rows:,} rows)")
    finish_axes(left, right)
    return saved(fig, out, "scaling.png")
