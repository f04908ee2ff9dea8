"""Fallback kernel (Adam on touched rows) against what a CPU user does today.

Peers, one process, same batches:

- ``dense``: ``nn.EmbeddingBag`` with dense gradients and ``torch.optim.Adam``;
- ``sparse_adam``: ``nn.EmbeddingBag(sparse=True)`` and ``torch.optim.SparseAdam``;
- ``fallback``: the table annotated with ``torch.optim.Adam``, sharded table_wise by
  ``sharders.EmbeddingBagCollectionSharder`` under ``DistributedModelParallel`` on a
  world of one (gloo), so it runs the real fallback path, input dist included.

A step is forward, backward and the update. Then the fallback alone at growing table
sizes with a fixed batch: its cost should follow the touched rows, not the table size.
Last, where the fallback's step goes: torch.profiler's self time of each operator,
summed by phase of ``update_rows`` (the compiled one pass, or, without it, gathers,
Adam math, scatters, ...), as a share of the step's wall time.
"""

from __future__ import annotations

import collections
import time

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


# Operators by phase of the fallback's step; the first match wins.
_PHASES = (
    ("the one compiled pass: sum duplicate ids, Adam, in place (overlap_optim::adam_rows_)",
     lambda name: name == "overlap_optim::adam_rows_"),
    ("scatter back: index_copy_ of the weight and 2 Adam states", lambda name: name == "aten::index_copy_"),
    ("sum the gradients of duplicate ids: unique (sort), index_add_",
     lambda name: name in ("aten::sort", "aten::_unique2", "aten::scatter_add_", "aten::index_add_")),
    ("lookup: FBGEMM's forward", lambda name: name.startswith("fbgemm::")),
    ("Python of the fallback backward (update_rows, step_tables, prepare/finish)",
     lambda name: name == "_LookupThenUpdateBackward"),
    ("TorchRec input/output dist", lambda name: name.startswith(("[", "##"))),
)
_OTHER = "other operators (head, autograd, cat, zeros ...)"


def phases(step: callable, rows: int, steps: int) -> dict[str, float]:
    """Share of ``step``'s wall time by phase: the self time of each operator, from torch.profiler.

    ``index_select`` on a ``rows``-row tensor is the gather of the weight and states; on any other
    tensor, the gradient of each looked-up id. Everything under a ``_foreach_`` op is the optimizer's
    math. The remainder (no operator running: Python outside operators, waits) closes the sum.
    """
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        wall_us = (time.perf_counter() - started) * 1e6
    totals: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        name, parent = event.name, event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::_foreach_"):
            parent = parent.cpu_parent
        if parent is not None or name.startswith("aten::_foreach_"):
            phase = "Adam math on the gathered rows (foreach ops)"
        elif name == "aten::index_select":
            gather = bool(event.input_shapes) and event.input_shapes[0][:1] == [rows]
            phase = ("gather: index_select of the weight and 2 Adam states" if gather
                     else "gradient of each looked-up id: index_select of the output gradient")
        else:
            phase = next((label for label, match in _PHASES if match(name)), _OTHER)
        totals[phase] += event.self_cpu_time_total
    shares = {phase: us / wall_us for phase, us in totals.most_common()}
    shares["outside operators (Python, waits)"] = max(0.0, 1 - sum(shares.values()))
    return shares


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
            "sparse_adam / fallback (target >= 2)": timings["sparse_adam"]["median_s"] / ours,
        },
        "phases": {"fallback (Adam), share of the step": phases(peers["fallback"], rows, 3 if quick else 20)},
    }
    sizes = [2_000, 20_000, 80_000] if quick else [100_000, 1_000_000, 4_000_000]
    scaling = {}
    for size in sizes:
        size_batches = [batch(size, bags, pooling, seed) for seed in range(4)]
        scaling[size] = time_peers({"fallback": _fallback_step(size, size_batches)}, warmup, repeats)["fallback"]
    base = scaling[sizes[0]]["median_s"]
    result["scaling"] = {str(k): {**v, "ratio_to_smallest": v["median_s"] / base} for k, v in scaling.items()}
    return result
