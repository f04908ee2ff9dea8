"""End-of-backward rounds: the all-reduces each training step issues, by phase, and the step time (2 ranks, gloo).

When backward ends, overlap_optim runs its end-of-backward rounds (``overlap_optim/round.py``):
each clipping set by norm has one (phase ``CLIP``: the global norm), and each sharded module with
layer-wise tables split across the ranks has one (phase ``STATISTICS``: the whole-table
statistics, ``overlap_optim/cross_shard_base.py``). Each round is one all-reduce until rounds of one
phase and process group merge; then a step makes one per phase, however many sets and modules.

Model: 3 EmbeddingBagCollections, each with one Adafactor table (20k x 64; quick: 2k x 64),
``row_wise``, ``column_wise`` and ``row_wise``, split across the 2 ranks by
``sharders.EmbeddingBagCollectionSharder`` under ``DistributedModelParallel``, and an MLP on the 3
pooled bags (Adam, in the DDP hook of ``sharders.DataParallelWrapper``); 256 bags of 10 ids per
table and rank (quick: 32 of 4), one thread per rank. Two clipping sets by 2-norm, declared before
DMP: the 3 tables, and the MLP; each binds at 0.3x the smallest norm of its first 3 steps.
Peers, the same process group, alternating in one run:

- ``separate``: that model (2 CLIP and 3 STATISTICS rounds);
- ``one_set``: one clipping set over the tables and the MLP (1 CLIP round, 3 STATISTICS);
- ``one_module``: the 3 tables in one collection (2 CLIP rounds, 1 STATISTICS; and one input and
  output dist instead of 3);
- ``unclipped``: no clipping (3 STATISTICS rounds).

Counting, after the timed steps (never during them), over a few steps of each peer:
``torch.distributed.all_reduce`` is wrapped in the rank processes only. A call is a round's when
a frame of its Python stack holds a ``Phase``, something whose ``phase`` is one (an
``EndOfBackwardRound``), or a list or dict of those; it is counted under the phase the innermost
such frame names, so the count does not depend on how the schedule issues it (today
``EndOfBackwardRound.run``, one call per round; merged, one per phase). The other calls are the
DDP hook's buckets. ``torch.profiler`` over the same steps counts every gloo all-reduce: those,
and the row_wise modules' output dists (TorchRec's reduce-scatter of the pooled embeddings,
which gloo runs as an all-reduce). No library code is changed, and only the public names of
``overlap_optim.round`` are read. The latency of one gloo all-reduce of one float64 in the same
group is measured too, to size what a round costs.
"""

from __future__ import annotations

import collections
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from benchmarks._timing import on_ranks, time_peers
from overlap_optim import apply_gradient_clipping, apply_optimizer_in_backward
from overlap_optim.round import EndOfBackwardRound, Phase

DIM, HIDDEN = 64, 128
TABLES = ("t0", "t1", "t2")
SHARDING = {"t0": "row_wise", "t1": "column_wise", "t2": "row_wise"}
# eps1 far below the clipped gradients: a floor that binds a touched element makes a split table refuse to step
TABLE_OPTIMIZER = (torch.optim.Adafactor, {"lr": 1e-2, "eps": (1e-16, 1e-3)})
DENSE_OPTIMIZER = (torch.optim.Adam, {"lr": 1e-3})
# peer -> (sharded modules, clipping sets by norm: 2 = the tables, the MLP; 1 = all of them; 0 = none)
PEERS = {"separate": (3, 2), "one_set": (3, 1), "one_module": (1, 2), "unclipped": (3, 0)}
SETTLING, BINDING = 3, 0.3  # max_norm: 0.3x the smallest norm of the first 3 steps (max_norm inf)
PHASES = tuple(p.name for p in Phase)
UNKNOWN = "round, phase unknown"  # a round's all-reduce whose stack names no single phase
OTHER = "other"  # an all_reduce call no round made (the DDP hook's buckets)


class _Bound:
    """A clipping set's ``max_norm``: inf for the first SETTLING steps, then BINDING x the smallest
    norm they saw. Not the first step's alone (``benchmarks/clipping.py``): the MLP's output starts
    far from the targets, and its first norm was 5x its later ones (quick mode: 0.28, then 0.05), a
    bound that never clipped."""

    def __init__(self) -> None:
        self.settling: list[float] = []
        self.last: float | None = None
        self.max_norm = math.inf

    def measured(self, norm: torch.Tensor) -> None:
        self.last = norm.item()
        if len(self.settling) < SETTLING:
            self.settling.append(self.last)
            if len(self.settling) == SETTLING:
                self.max_norm = BINDING * min(self.settling)

    def summary(self) -> dict:
        return {"settling_norms": self.settling, "max_norm": self.max_norm, "last_norm": self.last,
                "binds": self.last is not None and self.last > self.max_norm}


class _Model(nn.Module):
    """The 3 tables in ``modules`` EmbeddingBagCollections (``ebc0``...), on meta; an MLP on the pooled bags."""

    def __init__(self, rows: int, modules: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.groups = [list(TABLES)] if modules == 1 else [[t] for t in TABLES]
        for index, names in enumerate(self.groups):
            configs = [EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f_{n}"])
                       for n in names]
            setattr(self, f"ebc{index}", EmbeddingBagCollection(tables=configs, device=torch.device("meta")))
        self.dense = nn.Sequential(nn.Linear(len(TABLES) * DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def ebcs(self) -> list[EmbeddingBagCollection]:
        return [getattr(self, f"ebc{i}") for i in range(len(self.groups))]

    def weights(self) -> list[torch.Tensor]:
        return [ebc.embedding_bags[n].weight for ebc, names in zip(self.ebcs(), self.groups) for n in names]

    def forward(self, kjts: list[KeyedJaggedTensor], target: torch.Tensor) -> torch.Tensor:
        pooled = [ebc(kjt).values() for ebc, kjt in zip(self.ebcs(), kjts)]
        return (self.dense(torch.cat(pooled, dim=1)).squeeze(1) - target).square().mean()


def _inputs(groups: list[list[str]], rows: int, bags: int, pooling: int, seed: int) -> tuple:
    """(one KJT per collection, ``bags`` bags of ``pooling`` ids for each of its tables; random
    targets, so that the loss, and the norm the bounds are set from, stay up)."""
    generator = torch.Generator().manual_seed(seed)
    kjts = []
    for names in groups:
        ids = torch.randint(0, rows, (len(names) * bags * pooling,), generator=generator)
        kjts.append(KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f_{n}" for n in names], values=ids, lengths=torch.full((len(names) * bags,), pooling)))
    return kjts, torch.randn(bags, generator=generator)


def _peer(peer: str, rows: int, world_size: int, batches: list) -> tuple[Callable[[], None], list[_Bound]]:
    """(step, the bounds of its clipping sets) of one peer, sharded, its first SETTLING steps taken."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    import sharders

    modules, sets = PEERS[peer]
    model = _Model(rows, modules)
    apply_optimizer_in_backward(TABLE_OPTIMIZER[0], model.weights(), TABLE_OPTIMIZER[1])
    apply_optimizer_in_backward(DENSE_OPTIMIZER[0], model.dense.parameters(), DENSE_OPTIMIZER[1])
    dense = list(model.dense.parameters())
    members = {0: [], 1: [model.weights() + dense], 2: [model.weights(), dense]}[sets]
    clips = [apply_gradient_clipping(params, max_norm=float("inf")) for params in members]
    sharder = sharders.EmbeddingBagCollectionSharder()
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints={n: ParameterConstraints(sharding_types=[SHARDING[n]], min_partition=DIM // 2) for n in TABLES},
    ).collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   data_parallel_wrapper=sharders.DataParallelWrapper())
    inputs = [_inputs(model.groups, rows, *b) for b in batches]
    bounds = [_Bound() for _ in clips]
    state = {"i": 0}

    def step() -> None:
        dmp(*inputs[state["i"] % len(inputs)]).backward()
        state["i"] += 1
        for clip, bound in zip(clips, bounds):
            bound.measured(clip.total_norm)
            clip.max_norm = bound.max_norm

    for _ in range(SETTLING):  # makes the state, and measures the norms that set the bounds
        step()
    return step, bounds


# -- counting -------------------------------------------------------------------------------------


def _phase_of(value: object, depth: int = 2) -> str | None:
    """The phase ``value`` names: a Phase, something with a ``phase`` that is one (a round), or a
    list, tuple or dict of those (UNKNOWN if of several phases); None if it names none."""
    if isinstance(value, Phase):
        return value.name
    try:
        phase = getattr(value, "phase", None)
    except Exception:  # noqa: BLE001 (any local of any frame: a property may raise anything)
        return None
    if isinstance(phase, Phase):
        return phase.name
    if isinstance(value, dict):
        value = list(value.values())
    if depth == 0 or not isinstance(value, (list, tuple)) or len(value) > 1000:
        return None
    return _one({_phase_of(v, depth - 1) for v in value})


def _one(found: set[str | None]) -> str | None:
    """The one phase named among ``found``, UNKNOWN if several (or an unknown one), None if none."""
    found.discard(None)
    if not found:
        return None
    return found.pop() if len(found) == 1 else UNKNOWN


def _issuer(frame) -> str | None:
    """The phase of the round whose stack ``frame`` is in, read from the innermost frame that
    names one: the phase if one local names exactly one (a round's ``self`` beside a list of
    every armed round), else UNKNOWN; None for no round's."""
    while frame is not None:
        found = {_phase_of(value) for value in list(frame.f_locals.values())}
        found.discard(None)
        if found:
            named = found - {UNKNOWN}
            return named.pop() if len(named) == 1 else UNKNOWN
        frame = frame.f_back
    return None


class _AllReduces:
    """While entered, counts this process's ``torch.distributed.all_reduce`` calls by issuer
    (``{phase or "other": [calls, bytes]}``), and records every op with torch.profiler."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        self.profiled = 0

    def __enter__(self) -> _AllReduces:
        self._original = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            issuer = _issuer(sys._getframe(1)) or OTHER
            self.calls[issuer][0] += 1
            self.calls[issuer][1] += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = dist.distributed_c10d.all_reduce = counting
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        dist.all_reduce = dist.distributed_c10d.all_reduce = self._original
        self.profiled = sum(1 for e in self._profile.events() if e.name == "gloo:all_reduce")


def _count(step: Callable[[], None], steps: int) -> dict:
    """All-reduces per step over ``steps`` steps: by issuer (calls, bytes), and every gloo one (profiler)."""
    with _AllReduces() as counted:
        for _ in range(steps):
            step()
    return {"by_issuer": {k: {"calls": c / steps, "bytes": b / steps} for k, (c, b) in counted.calls.items()},
            "gloo_all_reduces": counted.profiled / steps}


def _latency_s(repeats: int) -> float:
    """Median seconds of one gloo all-reduce of one float64 in the default group."""
    buffer = torch.zeros(1, dtype=torch.float64)
    samples = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(buffer)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _body(rank: int, world_size: int, rows: int, bags: int, pooling: int, warmup: int, repeats: int,
          counted: int) -> dict:
    torch.set_num_threads(1)  # 2 ranks on 2 cores, as torchrun sets OMP_NUM_THREADS=1
    batches = [(bags, pooling, 10 * s + rank) for s in range(8)]  # each rank its own data
    built = {peer: _peer(peer, rows, world_size, batches) for peer in PEERS}
    timings = time_peers({peer: b[0] for peer, b in built.items()}, warmup, repeats)
    counts = {peer: _count(b[0], counted) for peer, b in built.items()}
    bounds = {peer: [b.summary() for b in found] for peer, (_, found) in built.items() if found}
    del built
    gc.collect()  # the peers' models and rounds: the quick group runs other benchmarks after this one
    return {"timings": timings, "counts": counts, "latency_s": _latency_s(50 if counted < 3 else 500), "bounds": bounds}


def _per_step(counts: dict) -> dict[str, float]:
    """One peer's all-reduces per step: each phase's rounds, their sum, the other
    ``all_reduce`` calls, and every gloo all-reduce (the profiler's)."""
    issuers = counts["by_issuer"]
    calls = {phase: issuers.get(phase, {"calls": 0.0})["calls"] for phase in PHASES}
    if UNKNOWN in issuers:
        calls[UNKNOWN] = issuers[UNKNOWN]["calls"]
    calls["rounds"] = sum(calls.values())
    calls["round bytes"] = sum(v["bytes"] for k, v in issuers.items() if k != OTHER)
    calls["other all_reduce calls"] = issuers.get(OTHER, {"calls": 0.0})["calls"]
    calls["every gloo all-reduce"] = counts["gloo_all_reduces"]
    return calls


def run(quick: bool) -> dict:
    """Measure; returns a JSON-able result with ratios."""
    rows, bags, pooling = (2_000, 32, 4) if quick else (20_000, 256, 10)
    warmup, repeats, counted = (1, 3, 2) if quick else (5, 100, 5)
    ranks = on_ranks(_body, rows, bags, pooling, warmup, repeats, counted, quick=quick, timeout=300 if quick else 1800)
    first = ranks[0]
    assert all(r["counts"] == first["counts"] for r in ranks), [r["counts"] for r in ranks]  # every rank alike
    median = {peer: t["median_s"] for peer, t in first["timings"].items()}
    all_reduces = {peer: _per_step(counts) for peer, counts in first["counts"].items()}
    separate = all_reduces["separate"]
    latency = max(r["latency_s"] for r in ranks)
    return {
        "setup": {"ranks": 2, "rows": rows, "dim": DIM, "bags_per_rank": bags, "pooling": pooling,
                  "sharding": SHARDING, "table_optimizer": TABLE_OPTIMIZER[0].__name__,
                  "dense_optimizer": DENSE_OPTIMIZER[0].__name__,
                  "peers": {p: {"modules": m, "clipping_sets": s} for p, (m, s) in PEERS.items()},
                  "warmup": warmup, "repeats": repeats, "counted_steps": counted,
                  "gloo_all_reduce_latency_us": latency * 1e6, "bounds": first["bounds"]},
        "timings": first["timings"],
        "all_reduces": all_reduces,
        "ratios": {
            "round all-reduces per step, separate (2 clipping sets, 3 modules)": separate["rounds"],
            "CLIP all-reduces per step, separate (target <= 1)": separate["CLIP"],
            "STATISTICS all-reduces per step, separate (target <= 1)": separate["STATISTICS"],
            "step time separate / one_set: a second clipping set": median["separate"] / median["one_set"],
            "step time separate / one_module: 3 modules instead of 1": median["separate"] / median["one_module"],
            "step time separate / unclipped: the 2 clipping sets": median["separate"] / median["unclipped"],
            "separate's round all-reduces at gloo's latency / its step time": (
                separate["rounds"] * latency / median["separate"]),
        },
    }
