"""Gradient clipping by norm in backward, against no clipping and torch's ``clip_grad_norm_`` (2 ranks, gloo).

Every clipped peer clips by the global 2-norm with ``max_norm`` at 0.3x the norm of its
first step (that step measures it with ``max_norm=inf``), so the bound really clips.

Sparse: the DLRM model of ``sparse_vs_torchrec`` (8 tables, SGD / Adagrad / row-wise
Adagrad, table_wise, a linear head), one thread per rank (as torchrun sets it; with two
threads per rank on 2 cores every peer is about 1.7x slower, and the ratios are noise),
under ``DistributedModelParallel`` with
``sharders.DataParallelWrapper``; the head is left unannotated and stepped by a user SGD
after backward. Peers, the same process group, alternating in one run:

- ``fused``: no clipping: FBGEMM fuses every table;
- ``fallback``: no clipping, every table pinned to the fallback kernel
  (``EmbeddingBagCollectionSharder(fallback_tables=...)``);
- ``clipped``: ``overlap_optim.apply_gradient_clipping`` over the tables and the head,
  declared before DMP; the tables stay fused, FBGEMM's backward held for the norm
  (``sharders.fused_clipping``);
- ``clipped_fallback``: the same clipping, every table pinned to the fallback: the other
  exact route.

Dense: the MLP tower of ``dense_hook`` (150 Linear layers, Adam at three learning rates),
at batch 16 and 256 per rank, one thread per rank. Peers, alternating in one run:

- ``ours``: DDP + ``overlap_optim.register_optimizer_hook``, no clipping;
- ``ours_clipped``: the same, ``apply_gradient_clipping(model.parameters(), max_norm)``
  declared before DDP;
- ``ddp_clip``: plain DDP, then ``torch.nn.utils.clip_grad_norm_`` (foreach) and
  ``torch.optim.Adam(foreach=True)`` after backward;
- ``ddp_foreach``: plain DDP and ``Adam(foreach=True)``, no clipping (what clipping costs torch's loop).

Peak RSS of ``ours_clipped`` and ``ddp_clip`` on the MLP at batch 256 is measured per peer in
a group of its own (``VmHWM`` of each rank).
"""

from __future__ import annotations

import gc
import math

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks._timing import on_ranks, own_peak_rss_kib, peak_rss_kib, time_peers
from benchmarks.dense_hook import LRS, WIDTHS, _ddp_plain, _thirds, _tower
from benchmarks.sparse_vs_torchrec import SETTINGS, _batches, _Model, _sizes
from overlap_optim import apply_gradient_clipping, apply_optimizer_in_backward, register_optimizer_hook

BINDING = 0.3  # max_norm, as a fraction of the first step's norm
SPARSE_PEERS = ("fused", "fallback", "clipped", "clipped_fallback")
DENSE_PEERS = ("ours", "ours_clipped", "ddp_clip", "ddp_foreach")
MEMORY_PEERS = ("ours_clipped", "ddp_clip")


class _Bound:
    """A clipped peer's bound and norms: ``max_norm`` inf for the first step, then 0.3x its norm."""

    def __init__(self) -> None:
        self.first = self.last = None
        self.max_norm = math.inf

    def measured(self, norm: torch.Tensor) -> None:
        self.last = norm.item()
        if self.first is None:
            self.first = self.last
            self.max_norm = BINDING * self.first

    def summary(self) -> dict:
        return {"first_norm": self.first, "max_norm": self.max_norm, "last_norm": self.last,
                "binds": self.last is not None and self.last > self.max_norm}


# -- sparse: the DLRM model of sparse_vs_torchrec --


def _sparse_peer(peer: str, rows: list[int], world_size: int, batches: list):
    """(step, bound or None, kernel kinds) of one peer of the sparse part."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    import sharders

    model = _Model(rows)
    for index, (_, cls, kwargs) in enumerate(SETTINGS):
        tables = [model.ebc.embedding_bags[f"t{i}"].weight for i in range(len(rows)) if i % 3 == index]
        apply_optimizer_in_backward(cls or RowWiseAdagrad, tables, kwargs)
    clipped = peer.startswith("clipped")
    clip = apply_gradient_clipping(model.parameters(), max_norm=math.inf) if clipped else None
    names = [f"t{i}" for i in range(len(rows))]
    pinned = names if peer in ("fallback", "clipped_fallback") else ()
    sharder = sharders.EmbeddingBagCollectionSharder(fallback_tables=pinned)
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints={n: ParameterConstraints(sharding_types=["table_wise"]) for n in names},
    ).collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   data_parallel_wrapper=sharders.DataParallelWrapper())
    head = torch.optim.SGD([p for n, p in dmp.named_parameters() if "head" in n], lr=0.01)
    kinds = sorted({t.kind.value for t in sharders.plan_of(dmp.module.ebc).tables.values()})
    bound = _Bound() if clip is not None else None
    state = {"i": 0}

    def step() -> None:
        kjt = batches[state["i"] % len(batches)]
        state["i"] += 1
        dmp(kjt).backward()
        head.step()
        head.zero_grad()
        if clip is not None:
            bound.measured(clip.total_norm)
            clip.max_norm = bound.max_norm

    if clip is not None:
        step()  # measures the first norm: the bound
    return step, bound, kinds


def _time_sparse(rank: int, world_size: int, quick: bool, warmup: int, repeats: int) -> dict:
    torch.set_num_threads(1)  # 2 ranks on 2 cores, as torchrun sets OMP_NUM_THREADS=1
    rows, batch, pooling = _sizes(quick)
    batches = _batches(rows, batch, pooling, rank)
    built = {peer: _sparse_peer(peer, rows, world_size, batches) for peer in SPARSE_PEERS}
    # A barrier before each timed step: the fallback peers' steps end at different times on the two
    # ranks (their page faults differ), and without it the next peer's first collective absorbed the
    # gap (measured: `clipped` 64 ms after `fused`, 97 ms after `fallback`, in one run).
    timings = time_peers({peer: b[0] for peer, b in built.items()}, warmup, repeats, before=dist.barrier)
    return {"timings": timings, "bound": {p: built[p][1].summary() for p in ("clipped", "clipped_fallback")},
            "kernels": {peer: b[2] for peer, b in built.items()}}


# -- dense: the MLP of dense_hook --


def _dense_peer(peer: str, layers: int, x: torch.Tensor):
    """(step, bound or None) of one peer of the dense part."""
    if peer in ("ddp_clip", "ddp_foreach"):
        plain, optimizer = _ddp_plain(layers, foreach=True)
        bound = _Bound() if peer == "ddp_clip" else None

        def step() -> None:
            plain(x).square().mean().backward()
            if bound is not None:
                bound.measured(torch.nn.utils.clip_grad_norm_(plain.parameters(), bound.max_norm, foreach=True))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        model = _tower(layers)
        for params, lr in zip(_thirds(model), LRS):
            apply_optimizer_in_backward(torch.optim.Adam, params, {"lr": lr})
        clip = apply_gradient_clipping(model.parameters(), max_norm=math.inf) if peer == "ours_clipped" else None
        ddp = DDP(model)
        register_optimizer_hook(ddp)
        bound = _Bound() if clip is not None else None

        def step() -> None:
            ddp(x).square().mean().backward()
            if clip is not None:
                bound.measured(clip.total_norm)
                clip.max_norm = bound.max_norm

    if bound is not None:
        step()  # measures the first norm: the bound
    return step, bound


def _time_dense(rank: int, world_size: int, layers: int, batch: int, warmup: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    x = torch.randn(batch, WIDTHS[0], generator=torch.Generator().manual_seed(rank))
    built = {peer: _dense_peer(peer, layers, x) for peer in DENSE_PEERS}
    timings = time_peers({peer: b[0] for peer, b in built.items()}, warmup, repeats)
    return {"timings": timings, "bounds": {peer: b[1].summary() for peer, b in built.items() if b[1] is not None}}


def _time(rank: int, world_size: int, quick: bool, layers: int, dense_batches: tuple[int, ...], warmup: int,
          repeats: int) -> tuple[dict, dict]:
    """Both parts in one group (each spawned group pays the imports again): the sparse part,
    then the dense part at each batch, one thread per rank."""
    sparse = _time_sparse(rank, world_size, quick, warmup, repeats)
    gc.collect()  # the sparse peers' tables
    return sparse, {batch: _time_dense(rank, world_size, layers, batch, warmup, repeats) for batch in dense_batches}


def _memory(rank: int, world_size: int, peer: str, layers: int, batch: int, steps: int) -> int:
    torch.set_num_threads(1)
    x = torch.randn(batch, WIDTHS[0], generator=torch.Generator().manual_seed(rank))
    step, _ = _dense_peer(peer, layers, x)
    for _ in range(steps):
        step()
    return own_peak_rss_kib()


def run(quick: bool) -> dict:
    """Measure; returns a JSON-able result with ratios."""
    rows, batch, pooling = _sizes(quick)
    layers, dense_batches = (6, (16,)) if quick else (150, (16, 256))
    warmup, repeats = (1, 3) if quick else (4, 24)
    sparse, dense_by_batch = on_ranks(_time, quick, layers, dense_batches, warmup, repeats, quick=quick, timeout=1800)[0]
    timings = {f"sparse {peer}": t for peer, t in sparse["timings"].items()}
    median = {peer: t["median_s"] for peer, t in sparse["timings"].items()}
    ratios = {
        "sparse clipped / fused: clipping, the tables fused (target <= 1.1)": median["clipped"] / median["fused"],
        "sparse clipped_fallback / fused: clipping, the tables moved to the fallback": (
            median["clipped_fallback"] / median["fused"]),
        "sparse clipped_fallback / clipped: the fallback route over the fused one": (
            median["clipped_fallback"] / median["clipped"]),
        "sparse clipped_fallback / fallback: clipping's own cost in the fallback": (
            median["clipped_fallback"] / median["fallback"]),
        "sparse fallback / fused: the same tables in the fallback": median["fallback"] / median["fused"],
    }
    bounds = {f"sparse {peer}": b for peer, b in sparse["bound"].items()}
    for dense_batch in dense_batches:
        dense = dense_by_batch[dense_batch]
        timings.update({f"dense {peer} (batch {dense_batch})": t for peer, t in dense["timings"].items()})
        bounds.update({f"dense {peer} (batch {dense_batch})": b for peer, b in dense["bounds"].items()})
        median = {peer: t["median_s"] for peer, t in dense["timings"].items()}
        clipped = median["ours_clipped"]
        ratios[f"dense ours_clipped / ours, batch {dense_batch} (target <= 1.15)"] = clipped / median["ours"]
        ratios[f"dense ddp_clip / ours_clipped, batch {dense_batch} (target >= 1)"] = median["ddp_clip"] / clipped
        ratios[f"dense ddp_clip / ddp_foreach: torch's clipping cost, batch {dense_batch}"] = (
            median["ddp_clip"] / median["ddp_foreach"])
    memory = peak_rss_kib(_memory, list(MEMORY_PEERS), layers, dense_batches[-1], 3 if quick else 10, quick=quick)
    ratios["dense peak RSS ours_clipped / ddp_clip"] = memory["ours_clipped"] / memory["ddp_clip"]
    return {
        "setup": {"ranks": 2, "binding": BINDING, "norm_type": 2.0, "repeats": repeats,
                  "sparse": {"tables": len(rows), "rows": rows, "batch_per_rank": batch, "pooling": pooling,
                             "sharding": "table_wise", "settings": [s[0] for s in SETTINGS],
                             "kernels": sparse["kernels"]},
                  "dense": {"parameter_tensors": sum(1 for _ in _tower(layers).parameters()), "layers": layers,
                            "batches_per_rank": list(dense_batches), "learning_rates": list(LRS),
                            "memory_batch": dense_batches[-1]},
                  "bounds": bounds},
        "timings": timings,
        "ratios": ratios,
        "peak_rss_kib": memory,
    }
