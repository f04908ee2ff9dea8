"""Gradient accumulation (``overlap_optim.no_step``): a window of k = 4 micro-batches against 4 plain steps (2 ranks, gloo).

The sparse DLRM model of ``sparse_vs_torchrec`` (8 tables, SGD / Adagrad / row-wise Adagrad,
table_wise, a linear head left to a user SGD), under ``DistributedModelParallel``, one thread
per rank (as torchrun sets it). Each peer runs the same 4 micro-batches per timed round:

- ``steps``: 4 plain steps, one per micro-batch (FBGEMM fuses every table);
- ``window``: one window: 3 micro-batches inside ``no_step``, then the last; fused tables keep
  each micro-batch's ids and output gradient and run one FBGEMM backward over their
  concatenation (``sharders.fused_backward``);
- ``window_fallback``: the same window with every table pinned to the fallback, the other exact
  route: the fallback sums each micro-batch's touched rows as it goes.

Memory: the peak RSS of each peer in a group of its own (``VmHWM`` of each rank), and what a
fused window holds before its last micro-batch (ids, offsets and output gradients), at k = 2, 4
and 8.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from benchmarks._timing import on_ranks, own_peak_rss_kib, peak_rss_kib, time_peers
from benchmarks.sparse_vs_torchrec import SETTINGS, _batches, _Model, _sizes
from overlap_optim import apply_optimizer_in_backward, get_optimizers, no_step

K = 4
PEERS = ("steps", "window", "window_fallback")


def _build(peer: str, rows: list[int], world_size: int):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    import sharders

    model = _Model(rows)
    for index, (_, cls, kwargs) in enumerate(SETTINGS):
        tables = [model.ebc.embedding_bags[f"t{i}"].weight for i in range(len(rows)) if i % 3 == index]
        apply_optimizer_in_backward(cls or RowWiseAdagrad, tables, kwargs)
    names = [f"t{i}" for i in range(len(rows))]
    sharder = sharders.EmbeddingBagCollectionSharder(fallback_tables=names if peer == "window_fallback" else ())
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints={n: ParameterConstraints(sharding_types=["table_wise"]) for n in names},
    ).collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   data_parallel_wrapper=sharders.DataParallelWrapper())
    return dmp, torch.optim.SGD([p for n, p in dmp.named_parameters() if "head" in n], lr=0.01)


def _stepper(peer: str, dmp, head, batches: list, k: int):
    keyed = get_optimizers(dmp)

    def steps() -> None:
        for kjt in batches[:k]:
            dmp(kjt).backward()
            keyed.step()
            head.step()
            head.zero_grad()

    def window() -> None:
        for m, kjt in enumerate(batches[:k]):
            with no_step(dmp) if m < k - 1 else contextlib.nullcontext():
                (dmp(kjt) / k).backward()
        keyed.step()
        head.step()
        head.zero_grad()

    return steps if peer == "steps" else window


def _time(rank: int, world_size: int, quick: bool, warmup: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    rows, batch, pooling = _sizes(quick)
    batches = _batches(rows, batch, pooling, rank, count=K)
    built = {peer: _stepper(peer, *_build(peer, rows, world_size), batches, K) for peer in PEERS}
    return time_peers(built, warmup, repeats)


def _memory(rank: int, world_size: int, peer: str, quick: bool, rounds: int) -> int:
    torch.set_num_threads(1)
    rows, batch, pooling = _sizes(quick)
    batches = _batches(rows, batch, pooling, rank, count=K)
    step = _stepper(peer, *_build(peer, rows, world_size), batches, K)
    for _ in range(rounds):
        step()
    return own_peak_rss_kib()


def _held(rank: int, world_size: int, quick: bool, ks: tuple[int, ...]) -> dict[int, int]:
    """Bytes the fused kernels of this rank hold before a window's last micro-batch, per k."""
    from sharders._private import kernels_of
    from sharders.fused_backward import held_backward_of

    torch.set_num_threads(1)
    rows, batch, pooling = _sizes(quick)
    batches = _batches(rows, batch, pooling, rank, count=max(ks))
    dmp, _ = _build("window", rows, world_size)
    held = {}
    for k in ks:
        for kjt in batches[: k - 1]:
            with no_step(dmp):
                (dmp(kjt) / k).backward()
        helds = [held_backward_of(kernel.emb_module) for _, kernel in kernels_of(dmp.module.ebc)]
        held[k] = sum(h.held_bytes() for h in helds if h is not None)
        (dmp(batches[k - 1]) / k).backward()  # closes the window
    return held


def run(quick: bool) -> dict:
    """Measure; returns a JSON-able result with ratios."""
    rows, batch, pooling = _sizes(quick)
    warmup, repeats, rounds = (1, 3, 2) if quick else (2, 12, 4)
    timings = on_ranks(_time, quick, warmup, repeats, quick=quick, timeout=1800)[0]
    median = {peer: t["median_s"] for peer, t in timings.items()}
    memory = peak_rss_kib(_memory, list(PEERS), quick, rounds, quick=quick)
    held = on_ranks(_held, quick, (2, 4, 8), quick=quick)
    held_mib = {k: max(r[k] for r in held) / 2**20 for k in (2, 4, 8)}
    ratios = {
        "window / 4 steps: one update instead of 4": median["window"] / median["steps"],
        "window_fallback / window: the fallback route over the fused one": median["window_fallback"] / median["window"],
        "peak RSS window / steps": memory["window"] / memory["steps"],
        "peak RSS window_fallback / steps": memory["window_fallback"] / memory["steps"],
    }
    return {
        "setup": {"ranks": 2, "k": K, "tables": len(rows), "rows": rows, "batch_per_rank": batch, "pooling": pooling,
                  "sharding": "table_wise", "settings": [s[0] for s in SETTINGS], "repeats": repeats},
        "timings": {f"{peer} ({K} micro-batches)": t for peer, t in timings.items()},
        "ratios": ratios,
        "peak_rss_kib": memory,
        "held_before_last_micro_batch_mib": held_mib,
    }
