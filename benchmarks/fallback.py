"""Fallback kernel (Adam on touched rows) against what a CPU user does today.

Peers, one process, same batches:

- ``dense``: ``nn.EmbeddingBag`` with dense gradients and ``torch.optim.Adam``;
- ``sparse_adam``: ``nn.EmbeddingBag(sparse=True)`` and ``torch.optim.SparseAdam``;
- ``fallback``: the table annotated with ``torch.optim.Adam``, sharded table_wise by
  ``sharders.EmbeddingBagCollectionSharder`` under ``DistributedModelParallel`` on a
  world of one (gloo), so it runs the real fallback path, input dist included.

A step is forward, backward and the update. Then the fallback alone at growing table
sizes with a fixed batch: its cost should follow the touched rows, not the table size.
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks._sharded import DIM, batch, sharded_step
from benchmarks._timing import time_peers

LR = 1e-3


def _fallback_step(rows: int, batches: list) -> callable:
    return sharded_step(rows, batches, torch.optim.Adam, {"lr": LR})


def _eager_step(rows: int, batches: list, sparse: bool) -> callable:
    bag = nn.EmbeddingBag(rows, DIM, mode="sum", sparse=sparse)
    head = nn.Linear(DIM, 1)
    table_opt = torch.optim.SparseAdam(bag.parameters(), lr=LR) if sparse else torch.optim.Adam(bag.parameters(), lr=LR)
    head_opt = torch.optim.Adam(head.parameters(), lr=LR)
    state = {"i": 0}

    def step() -> None:
        ids, offsets = batches[state["i"] % len(batches)]
        state["i"] += 1
        head(bag(ids, offsets)).sum().backward()
        table_opt.step()
        head_opt.step()
        table_opt.zero_grad(set_to_none=True)
        head_opt.zero_grad(set_to_none=True)

    return step


def run(quick: bool) -> dict:
    """Measure; returns a JSON-able result with ratios."""
    rows = 20_000 if quick else 1_000_000
    bags, pooling = (256, 1) if quick else (2048, 5)
    warmup, repeats = (1, 3) if quick else (3, 15)
    batches = [batch(rows, bags, pooling, seed) for seed in range(4)]
    touched = len(torch.unique(batches[0][0]))
    peers = {
        "dense": _eager_step(rows, batches, sparse=False),
        "sparse_adam": _eager_step(rows, batches, sparse=True),
        "fallback": _fallback_step(rows, batches),
    }
    timings = time_peers(peers, warmup, repeats)
    ours = timings["fallback"]["median_s"]
    result = {
        "setup": {"rows": rows, "dim": DIM, "bags": bags, "pooling": pooling, "touched_rows": touched,
                  "touched_fraction": touched / rows, "repeats": repeats},
        "timings": timings,
        "ratios": {
            "dense / fallback (target >= 10)": timings["dense"]["median_s"] / ours,
            "sparse_adam / fallback (target >= 1)": timings["sparse_adam"]["median_s"] / ours,
        },
    }
    sizes = [2_000, 20_000, 80_000] if quick else [100_000, 1_000_000, 4_000_000]
    scaling = {}
    for size in sizes:
        size_batches = [batch(size, bags, pooling, seed) for seed in range(4)]
        scaling[size] = time_peers({"fallback": _fallback_step(size, size_batches)}, warmup, repeats)["fallback"]
    base = scaling[sizes[0]]["median_s"]
    result["scaling"] = {str(k): {**v, "ratio_to_smallest": v["median_s"] / base} for k, v in scaling.items()}
    return result
