"""How close the sparse step comes to the machine's memory bandwidth (one process, 2 threads).

1. The limit: copy (``b.copy_(a)``, 2 x 4 bytes per element) and triad
   (``a = b + 2 c``, 3 x 4 bytes per element) on tensors far larger than the caches.
2. The bytes a training step must move, at least (a lower bound, so achieved
   bandwidth is a generous measure):

   - forward: read every looked-up row (N x D x 4) and the ids (N x 8), write the
     pooled output (B x D x 4);
   - backward: read the output gradient (B x D x 4) and the ids again, then for
     each of the U touched rows read and write the weight row and the optimizer
     state: row-wise Adagrad one float per row, Adam two rows (exp_avg, exp_avg_sq).

3. Four kernels on the same batches: FBGEMM's fused TBE alone (row-wise Adagrad),
   our fused path through DistributedModelParallel on a world of one (input dist
   included; FBGEMM's lookup, our compiled backward), the same with FBGEMM's own
   backward, and our fallback (Adam) the same way. Achieved bandwidth = bytes /
   median step time, as a fraction of the measured triad bandwidth.
4. Where the time goes: the top operators by self CPU time, from torch.profiler.
"""

from __future__ import annotations

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from benchmarks._sharded import DIM, batch, sharded_step
from benchmarks._timing import time_peers

ROW = DIM * 4  # bytes of one fp32 row
OURS_FUSED = "fused, our sharded path (row-wise Adagrad)"


def _bandwidth(elements: int, warmup: int, repeats: int) -> dict[str, float]:
    a, b, c = (torch.rand(elements) for _ in range(3))
    timings = time_peers({"copy": lambda: b.copy_(a), "triad": lambda: torch.add(b, c, alpha=2.0, out=a)},
                         warmup, repeats)
    return {"copy_gb_s": 2 * 4 * elements / timings["copy"]["median_s"] / 1e9,
            "triad_gb_s": 3 * 4 * elements / timings["triad"]["median_s"] / 1e9}


def _tbe_step(rows: int, batches: list) -> callable:
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(rows, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01, eps=1e-8,
    )
    inputs = [(ids, torch.cat([offs, torch.tensor([ids.numel()])])) for ids, offs in batches]
    state = {"i": 0}

    def step() -> None:
        ids, offsets = inputs[state["i"] % len(inputs)]
        state["i"] += 1
        out = tbe(ids, offsets)
        out.backward(torch.ones_like(out))

    return step


def _bytes(lookups: int, touched: int, bags: int, state_per_row: int) -> int:
    forward = lookups * ROW + lookups * 8 + bags * ROW
    backward = bags * ROW + lookups * 8 + touched * 2 * (ROW + state_per_row)
    return forward + backward


def _top_ops(step: callable, steps: int = 3, top: int = 5) -> list[tuple[str, float]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [(e.key, 100.0 * e.self_cpu_time_total / total) for e in events[:top]]


def run(quick: bool) -> dict:
    """Measure; returns a JSON-able result with ratios."""
    elements = 4_000_000 if quick else 64_000_000
    rows, bags, pooling = (50_000, 256, 5) if quick else (2_000_000, 2048, 20)
    warmup, repeats = (1, 3) if quick else (3, 12)
    limit = _bandwidth(elements, warmup, repeats)
    batches = [batch(rows, bags, pooling, seed, zipf=True) for seed in range(4)]
    lookups = bags * pooling
    touched = sum(len(torch.unique(ids)) for ids, _ in batches) // len(batches)
    kernels = {
        "fused TBE alone (row-wise Adagrad)": (_tbe_step(rows, batches), 4),
        "fused, our sharded path (row-wise Adagrad)": (sharded_step(rows, batches, RowWiseAdagrad, {"lr": 0.01}), 4),
        "fused, our sharded path with FBGEMM's backward (row-wise Adagrad)": (
            sharded_step(rows, batches, RowWiseAdagrad, {"lr": 0.01}, own_backward=False), 4),
        "fallback, our sharded path (Adam)": (sharded_step(rows, batches, torch.optim.Adam, {"lr": 0.01}), 2 * ROW),
    }
    timings = time_peers({k: fn for k, (fn, _) in kernels.items()}, warmup, repeats)
    achieved, ratios, profiles = {}, {}, {}
    for name, (fn, state) in kernels.items():
        moved = _bytes(lookups, touched, bags, state)
        achieved[name] = {"bytes_per_step": moved, "gb_s": moved / timings[name]["median_s"] / 1e9}
        target = " (target >= 0.5)" if "TBE" in name else " (target >= 0.25)" if name == OURS_FUSED else ""
        ratios[f"{name}: achieved / triad bandwidth{target}"] = (
            achieved[name]["gb_s"] / limit["triad_gb_s"])
        profiles[name] = _top_ops(fn)
    return {
        "setup": {"elements": elements, "rows": rows, "dim": DIM, "bags": bags, "pooling": pooling,
                  "lookups": lookups, "touched_rows": touched, "repeats": repeats},
        "limit": limit,
        "timings": timings,
        "achieved": achieved,
        "profiles": profiles,
        "ratios": ratios,
    }
