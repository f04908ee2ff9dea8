"""The sparse path against stock TorchRec, on optimizers both fuse exactly (2 ranks, gloo).

Model: 8 tables of 100k-500k rows, dim 64, pooling 20 (Zipf-like ids), batch 2048
per rank, table_wise, and a linear head. ``run(quick, collection="ec")`` measures
the same tables in an EmbeddingCollection (20 ids per sample, unpooled, the head
on each id's row): ``benchmarks/ec_vs_torchrec.py``. The tables use three settings that
FBGEMM computes exactly and that stock TorchRec passes through correctly:
SGD, Adagrad with eps given, row-wise Adagrad without weight decay.

Peers, the same process group, alternating in one run:

- ``ours``: tables annotated with ``overlap_optim.apply_optimizer_in_backward``
  (one call per setting), sharded by ``sharders.EmbeddingBagCollectionSharder``
  (``EmbeddingCollectionSharder``);
- ``torchrec``: the same annotations made by ``torchrec.optim.apply_optimizer_in_backward``,
  sharded by TorchRec's own sharder of the collection;
- ``ours_fbgemm_backward``: ``ours`` with FBGEMM's own backward in the fused kernels, as where the
  compiled extension is not built (what ``sharders.fused_rows`` changes).

Both heads are plain DDP + SGD. Peak RSS is measured per peer in a group of its own.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from benchmarks._sharded import fbgemm_backward
from benchmarks._timing import on_ranks, own_peak_rss_kib, peak_rss_kib, time_peers

DIM = 64
PEERS = ("ours", "torchrec", "ours_fbgemm_backward")
STEP_TARGET = {"ebc": 0.75, "ec": 0.8}  # ours / stock TorchRec, step time (issue 42)
SETTINGS = [
    ("sgd", torch.optim.SGD, {"lr": 0.01}),
    ("adagrad", torch.optim.Adagrad, {"lr": 0.01, "eps": 1e-8}),
    ("rowwise", None, {"lr": 0.01, "eps": 1e-8}),  # torchrec's RowWiseAdagrad
]


class _Model(nn.Module):
    """The tables in an EmbeddingBagCollection (``self.ebc``: the head reads the pooled bags) or an
    EmbeddingCollection (``self.ec``: the head reads every id's row)."""

    def __init__(self, rows: list[int], collection: str = "ebc") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.collection = collection
        config, module = (EmbeddingBagConfig, EmbeddingBagCollection) if collection == "ebc" else (
            EmbeddingConfig, EmbeddingCollection)
        tables = [config(name=f"t{i}", embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{i}"])
                  for i, n in enumerate(rows)]
        setattr(self, collection, module(tables=tables, device=torch.device("meta")))
        self.head = nn.Linear(DIM * len(rows) if collection == "ebc" else DIM, 1)

    def weight(self, table: str) -> torch.Tensor:
        holder = self.ebc.embedding_bags if self.collection == "ebc" else self.ec.embeddings
        return holder[table].weight

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        looked_up = getattr(self, self.collection)(kjt)
        if self.collection == "ebc":
            return self.head(looked_up.values()).square().mean()
        return self.head(torch.cat([jt.values() for jt in looked_up.values()])).square().mean()


def _sizes(quick: bool) -> tuple[list[int], int, int]:
    if quick:
        return [2_000 + 500 * i for i in range(8)], 64, 4
    return [100_000, 150_000, 200_000, 250_000, 300_000, 350_000, 400_000, 500_000], 2048, 20


def _build(peer: str, rows: list[int], world_size: int, collection: str):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder as StockECSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as StockEBCSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward as stock_annotate
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    import sharders
    from overlap_optim import apply_optimizer_in_backward

    model = _Model(rows, collection)
    annotate = stock_annotate if peer == "torchrec" else apply_optimizer_in_backward
    for index, (_, cls, kwargs) in enumerate(SETTINGS):
        tables = [model.weight(f"t{i}") for i in range(len(rows)) if i % 3 == index]
        annotate(cls or RowWiseAdagrad, tables, dict(kwargs))  # TorchRec's sharder rewrites the dict it keeps
    ours = sharders.EmbeddingBagCollectionSharder if collection == "ebc" else sharders.EmbeddingCollectionSharder
    stock = StockEBCSharder if collection == "ebc" else StockECSharder
    sharder = stock() if peer == "torchrec" else ours()
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(len(rows))}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    with fbgemm_backward() if peer == "ours_fbgemm_backward" else contextlib.nullcontext():
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    head = torch.optim.SGD([p for n, p in dmp.named_parameters() if "head" in n], lr=0.01)
    return dmp, head


def _batches(rows: list[int], batch: int, pooling: int, rank: int, count: int = 4) -> list[KeyedJaggedTensor]:
    out = []
    for seed in range(count):
        generator = torch.Generator().manual_seed(seed * 31 + rank)
        values = [(torch.rand(batch * pooling, generator=generator).pow(2) * n).long() for n in rows]
        out.append(KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(len(rows))], values=torch.cat(values),
            lengths=torch.full((batch * len(rows),), pooling, dtype=torch.long)))
    return out


def _stepper(dmp, head, batches):
    state = {"i": 0}

    def step() -> None:
        kjt = batches[state["i"] % len(batches)]
        state["i"] += 1
        dmp(kjt).backward()
        head.step()
        head.zero_grad()

    return step


def _time(rank: int, world_size: int, quick: bool, warmup: int, repeats: int, collection: str) -> dict:
    rows, batch, pooling = _sizes(quick)
    batches = _batches(rows, batch, pooling, rank)
    peers = {peer: _stepper(*_build(peer, rows, world_size, collection), batches) for peer in PEERS}
    return time_peers(peers, warmup, repeats)


def _memory(rank: int, world_size: int, peer: str, quick: bool, steps: int, collection: str) -> int:
    rows, batch, pooling = _sizes(quick)
    step = _stepper(*_build(peer, rows, world_size, collection), _batches(rows, batch, pooling, rank))
    for _ in range(steps):
        step()
    return own_peak_rss_kib()


def run(quick: bool, collection: str = "ebc") -> dict:
    """Measure; returns a JSON-able result with ratios. ``collection``: "ebc" or "ec"."""
    rows, batch, pooling = _sizes(quick)
    warmup, repeats = (1, 3) if quick else (4, 24)
    timings = on_ranks(_time, quick, warmup, repeats, collection, quick=quick, timeout=900)[0]
    memory = peak_rss_kib(_memory, ["ours", "torchrec"], quick, 2 if quick else 5, collection, quick=quick)
    return {
        "setup": {"collection": collection, "tables": len(rows), "rows": rows, "dim": DIM, "batch_per_rank": batch,
                  "ids_per_sample": pooling, "ranks": 2, "sharding": "table_wise",
                  "settings": [s[0] for s in SETTINGS], "repeats": repeats},
        "timings": timings,
        "peak_rss_kib": memory,
        "ratios": {
            f"ours / torchrec, step time (target <= {STEP_TARGET[collection]})":
                timings["ours"]["median_s"] / timings["torchrec"]["median_s"],
            "ours_fbgemm_backward / torchrec, step time: FBGEMM's backward in our path":
                timings["ours_fbgemm_backward"]["median_s"] / timings["torchrec"]["median_s"],
            "ours / ours_fbgemm_backward, step time: our compiled backward against FBGEMM's":
                timings["ours"]["median_s"] / timings["ours_fbgemm_backward"]["median_s"],
            "ours / torchrec, peak RSS (target <= 1.05)": memory["ours"] / memory["torchrec"],
        },
    }
