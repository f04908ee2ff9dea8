"""Many small tables, many settings: our bookkeeping against stock TorchRec as the tables grow (2 ranks, gloo).

Model: T tables of 1,000-5,000 rows, dims 16 and 32, one feature each, table_wise, a linear head
(the user's SGD, plain DDP, in both peers); S distinct settings (fused Adagrad, eps 1e-8, S learning
rates, table i at setting i % S); batch 256 per rank, 1-3 ids per bag. Swept over T in {8, 64, 256,
1024} and S in {1, 32} (quick: T in {4, 16}, S in {1, 4}). Both peers run the same FBGEMM kernels
(same fused params per setting) in the same process group:

- ``ours``: annotated with ``overlap_optim.apply_optimizer_in_backward``, planned by
  ``sharders.EmbeddingShardingPlanner``, sharded by ``sharders.EmbeddingBagCollectionSharder``;
- ``torchrec``: annotated with ``torchrec.optim.apply_optimizer_in_backward``, planned and sharded
  by TorchRec's own planner and sharder.

Per (T, S), on rank 0: the annotation calls on a fresh model (per call), the build (plan + DMP; each
peer built once at T = 2 first, untimed, so that neither pays a process's first-build costs; then the
median of 3 builds, the peers in turn, 1 in quick mode; annotation: the median call of each build's,
then the median of the builds'),
the step (interleaved), and ``state_dict()`` and ``load_state_dict()`` of each peer's optimizer
(``get_optimizers(dmp)`` against ``dmp.fused_optimizer``, interleaved). Peak RSS per peer in processes of their own at the
largest T with S = 32 (quick: in one group). Plotted against T.
"""

from __future__ import annotations

import functools
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._plots import finish_axes, saved
from benchmarks._timing import on_ranks, own_peak_rss_kib, peak_rss_kib, time_peers

PEERS = ("ours", "torchrec")
BATCH = 256
TARGETS = {"step": 0.90, "build": 1.2, "annotate": 5.0}  # and state_dict(): 10x stock's, or under 50 ms


def _sweep(quick: bool) -> list[tuple[int, int]]:
    tables, settings = ((4, 16), (1, 4)) if quick else ((8, 64, 256, 1024), (1, 32))
    return [(t, s) for t in tables for s in settings]


class _Model(nn.Module):
    def __init__(self, tables: int) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        torch.manual_seed(0)
        self.dims = [16 if i % 2 == 0 else 32 for i in range(tables)]
        configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=1_000 + (i * 997) % 4_001,
                                      feature_names=[f"f{i}"]) for i, d in enumerate(self.dims)]
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        self.head = nn.Linear(sum(self.dims), 1)

    def forward(self, kjt) -> torch.Tensor:
        return self.head(self.ebc(kjt).values()).square().mean()


def _annotate(model: _Model, peer: str, settings: int) -> float:
    """Annotate every table, one call per setting; the median seconds of a call (a garbage collection
    that lands in one call of stock's 0.1 ms would otherwise be most of the mean)."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward as stock_annotate

    from overlap_optim import apply_optimizer_in_backward

    annotate = stock_annotate if peer == "torchrec" else apply_optimizer_in_backward
    tables = model.ebc.embedding_bags
    calls = []
    for s in range(settings):
        weights = [tables[f"t{i}"].weight for i in range(len(model.dims)) if i % settings == s]
        started = time.perf_counter()
        annotate(torch.optim.Adagrad, weights, {"lr": 0.01 * (1 + s / settings), "eps": 1e-8})
        calls.append(time.perf_counter() - started)
    return sorted(calls)[len(calls) // 2]


def _build(peer: str, tables: int, settings: int, world_size: int) -> tuple[dict, nn.Module, torch.optim.Optimizer, float]:
    """(timings, the DMP, the head's optimizer, the optimizer whose state_dict is timed)."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as StockSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner as StockPlanner
    from torchrec.distributed.planner import ParameterConstraints, Topology

    import overlap_optim
    import sharders

    model = _Model(tables)
    annotate_s = _annotate(model, peer, min(settings, tables))  # T = 8, S = 32: each table a setting of its own
    started = time.perf_counter()
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(tables)}
    topology = Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size)
    planner_class, sharder = ((StockPlanner, StockSharder()) if peer == "torchrec"
                              else (sharders.EmbeddingShardingPlanner, sharders.EmbeddingBagCollectionSharder()))
    plan = planner_class(topology=topology, constraints=constraints).collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    build_s = time.perf_counter() - started
    head = torch.optim.SGD([p for n, p in dmp.named_parameters() if "head" in n], lr=0.01)
    keyed = dmp.fused_optimizer if peer == "torchrec" else overlap_optim.get_optimizers(dmp)
    return {"annotate_per_call_s": annotate_s, "build_s": build_s}, dmp, head, keyed


def _batches(tables: int, rank: int, count: int = 4) -> list:
    from torchrec import KeyedJaggedTensor

    out = []
    for seed in range(count):
        generator = torch.Generator().manual_seed(seed * 31 + rank)
        lengths = torch.randint(1, 4, (tables * BATCH,), generator=generator)
        rows = torch.tensor([1_000 + (i * 997) % 4_001 for i in range(tables)]).repeat_interleave(BATCH)
        values = (torch.rand(int(lengths.sum()), generator=generator)
                  * rows.repeat_interleave(lengths)).long()
        out.append(KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(tables)], values=values,
                                                       lengths=lengths))
    return out


def _measure(rank: int, world_size: int, tables: int, settings: int, quick: bool) -> dict:
    warnings.filterwarnings("ignore")  # the bare head's warning from get_optimizers; TorchRec's planner notes
    for peer in PEERS:  # untimed: what the first build in a process pays once (imports, TorchRec's caches)
        _build(peer, 2, 1, world_size)
    built, timings = {}, {peer: [] for peer in PEERS}
    for turn in range(1 if quick else 3):  # one build is a few seconds of Python: the median of 3, in turn
        for peer in PEERS if turn % 2 == 0 else PEERS[::-1]:
            built.pop(peer, None)  # the previous build of this peer, dropped before the next is timed
            built[peer] = _build(peer, tables, settings, world_size)
            timings[peer].append(built[peer][0])
    for peer in PEERS:
        for key in built[peer][0]:
            built[peer][0][key] = sorted(t[key] for t in timings[peer])[len(timings[peer]) // 2]
    batches = _batches(tables, rank)

    def stepper(dmp, head):
        state = {"i": 0}

        def step() -> None:
            dmp(batches[state["i"] % len(batches)]).backward()
            state["i"] += 1
            head.step()
            head.zero_grad()
        return step

    warmup, repeats = (1, 2) if quick else (3, 15)
    steps = time_peers({p: stepper(built[p][1], built[p][2]) for p in PEERS}, warmup, repeats,
                       before=dist.barrier)
    state_dicts = time_peers({p: built[p][3].state_dict for p in PEERS}, 1, 2 if quick else 5)
    saved = {p: built[p][3].state_dict() for p in PEERS}
    loads = time_peers({p: functools.partial(built[p][3].load_state_dict, saved[p]) for p in PEERS}, 1,
                       2 if quick else 5)
    return {peer: {**built[peer][0], "step_s": steps[peer]["median_s"], "state_dict_s": state_dicts[peer]["median_s"],
                   "load_state_dict_s": loads[peer]["median_s"]}
            for peer in PEERS}


def _peak(rank: int, world_size: int, peer: str, tables: int, settings: int) -> int:
    warnings.filterwarnings("ignore")
    _, dmp, head, _ = _build(peer, tables, settings, world_size)
    for kjt in _batches(tables, rank, count=3):
        dmp(kjt).backward()
        head.step()
        head.zero_grad()
    return own_peak_rss_kib()


def run(quick: bool, out: Path | None = None) -> dict:
    """Measure (and plot into ``out``); returns a JSON-able result with ratios."""
    by_config = {}
    for tables, settings in _sweep(quick):
        by_config[f"T={tables},S={settings}"] = on_ranks(_measure, tables, settings, quick, quick=quick,
                                                         timeout=3600)[0]
    largest = max(t for t, _ in _sweep(quick))
    most = max(s for _, s in _sweep(quick))
    memory = peak_rss_kib(_peak, list(PEERS), largest, most, quick=quick, timeout=3600)
    ratios = ratios_of(by_config, memory, f"T={largest},S={most}")
    plots = _plot(by_config, out) if out is not None else []
    return {
        "setup": {"tables": sorted({t for t, _ in _sweep(quick)}), "settings": sorted({s for _, s in _sweep(quick)}),
                  "batch_per_rank": BATCH, "ids_per_bag": "1-3", "ranks": 2, "sharding": "table_wise"},
        "by_config": by_config,
        "peak_rss_kib": memory,
        "ratios": ratios,
        "plots": plots,
    }


def ratios_of(by_config: dict, memory: dict, largest: str) -> dict[str, float]:
    """The ratios against stock TorchRec, and state_dict() against 50 ms (the target is met when either
    that or the ratio's 10x is), for the most settings at the smallest, the issue's (256) and the largest
    T (every configuration is in ``by_config`` and the plot)."""
    ratios = {}
    most = max(int(c.split("S=")[1]) for c in by_config)
    sizes = sorted(int(c.split(",")[0][2:]) for c in by_config if c.endswith(f"S={most}"))
    shown = {f"T={t},S={most}" for t in (sizes[0], 256, sizes[-1])}
    for config, peers in by_config.items():
        if config not in shown:
            continue
        for what, key in (("step", "step_s"), ("build", "build_s"), ("annotate", "annotate_per_call_s")):
            # the step's target is the T = 256 (and there no worse than at the smallest T, below)
            target = f" (target <= {TARGETS[what]})" if what != "step" or config.startswith("T=256,") else ""
            ratios[f"{config}: {what}, ours / torchrec{target}"] = peers["ours"][key] / peers["torchrec"][key]
        ratios[f"{config}: state_dict, ours / torchrec"] = peers["ours"]["state_dict_s"] / peers["torchrec"]["state_dict_s"]
        ratios[f"{config}: state_dict, ours / 50 ms (target <= 1)"] = peers["ours"]["state_dict_s"] / 0.05
        if "load_state_dict_s" in peers["ours"]:  # measured from 2026-11-28 on
            ratios[f"{config}: load_state_dict, ours / torchrec"] = (
                peers["ours"]["load_state_dict_s"] / peers["torchrec"]["load_state_dict_s"])
            smallest = by_config[f"T={sizes[0]},S={most}"]["ours"]["load_state_dict_s"] / sizes[0]
            ratios[f"{config}: load_state_dict per table, ours / at T={sizes[0]} (linear: <= 1)"] = (
                peers["ours"]["load_state_dict_s"] / int(config.split(",")[0][2:]) / smallest)
    if f"T=256,S={most}" in by_config:
        def step(config: str) -> float:
            return by_config[config]["ours"]["step_s"] / by_config[config]["torchrec"]["step_s"]
        ratios[f"step, ours / torchrec at T=256 over at T={sizes[0]} (S={most}; target <= 1)"] = (
            step(f"T=256,S={most}") / step(f"T={sizes[0]},S={most}"))
    ratios[f"{largest}: peak RSS, ours / torchrec"] = memory["ours"] / memory["torchrec"]
    return ratios


def _plot(by_config: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    what = (("step_s", "step"), ("build_s", "build (plan + DMP)"), ("annotate_per_call_s", "annotate, per call"),
            ("state_dict_s", "state_dict()"))
    fig, axes = plt.subplots(1, len(what), figsize=(16, 4))
    settings = sorted({int(c.split("S=")[1]) for c in by_config})
    for axis, (key, title) in zip(axes, what):
        for s, style in zip(settings, ("o-", "s--", "^:")):
            points = sorted((int(c.split(",")[0][2:]), p) for c, p in by_config.items() if c.endswith(f"S={s}"))
            axis.plot([t for t, _ in points], [p["ours"][key] / p["torchrec"][key] for _, p in points], style,
                      label=f"S = {s}")
        axis.axhline(1.0, color="grey", lw=0.8)
        axis.set(xscale="log", xlabel="tables (T)", ylabel="ours / torchrec", title=title)
    finish_axes(*axes)
    return saved(fig, out, "many_tables.png")
