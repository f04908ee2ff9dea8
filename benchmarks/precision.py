"""Low-precision tables and optimizer state: memory and step time against float32 (2 ranks, gloo).

One Adam table (4M x 64 in the full run; ``--quick``: 20k x 64), row_wise over 2 ranks, in the
fallback on touched rows, batch 512 per rank, pooling 8, and a linear head (plain SGD). Peers:

- ``fp32``: FP32 weights, float32 Adam state;
- ``fp16``: FP16 weights, float32 state (``data_type=DataType.FP16``);
- ``fp16_bf16``: FP16 weights, BF16 state (``state_dtype=torch.bfloat16``).

And row-wise Adagrad on FP16 weights, table_wise, against stock TorchRec, whose fused FBGEMM
kernel runs FP16 on CPU but rounds each update twice (``stock_rowwise_fp16``). Ours fuses it where
our compiled backward runs (FBGEMM's lookup, our pass: float32 arithmetic, one rounding;
``ours_rowwise_fp16``), and ``fallback_rowwise_fp16`` is the same table pinned to the fallback
(what ran before the compiled backward took FP16 tables).

Peak RSS is each peer's own group's (``VmHWM`` of each rank, after a few steps); step time
alternates the peers in one group. Weights plus Adam's two moments: 12 bytes a float32 element,
10 with FP16 weights, 6 with BF16 state (0.5x).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType

from benchmarks._timing import on_ranks, own_peak_rss_kib, peak_rss_kib, time_peers
from benchmarks.sparse_vs_torchrec import _stepper

DIM = 64
ADAM = ("fp32", "fp16", "fp16_bf16")
ROWWISE = ("ours_rowwise_fp16", "stock_rowwise_fp16", "fallback_rowwise_fp16")


def _sizes(quick: bool) -> tuple[int, int, int]:
    """(rows, batch per rank, pooling)."""
    return (20_000, 64, 4) if quick else (4_000_000, 512, 8)


class _Model(nn.Module):
    def __init__(self, rows: int, data_type: DataType) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(device=torch.device("meta"), tables=[
            EmbeddingBagConfig(name="t0", embedding_dim=DIM, num_embeddings=rows, feature_names=["f0"],
                               data_type=data_type)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.ebc(kjt)["f0"].float()).square().mean()


def _build(peer: str, rows: int, world_size: int):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as StockSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward as stock_annotate
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    import sharders
    from overlap_optim import apply_optimizer_in_backward

    torch.manual_seed(0)
    model = _Model(rows, DataType.FP32 if peer == "fp32" else DataType.FP16)
    weight = model.ebc.embedding_bags["t0"].weight
    if peer in ADAM:
        state = torch.bfloat16 if peer == "fp16_bf16" else None
        apply_optimizer_in_backward(torch.optim.Adam, [weight], {"lr": 0.01}, state_dtype=state)
        sharding = "row_wise"
    else:
        annotate = stock_annotate if peer.startswith("stock") else apply_optimizer_in_backward
        annotate(RowWiseAdagrad, [weight], {"lr": 0.01, "eps": 1e-8})
        sharding = "table_wise"
    pinned = ["t0"] if peer.startswith("fallback") else []
    sharder = StockSharder() if peer.startswith("stock") else sharders.EmbeddingBagCollectionSharder(
        fallback_tables=pinned)
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints={"t0": ParameterConstraints(sharding_types=[sharding])},
    ).collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    head = torch.optim.SGD([p for n, p in dmp.named_parameters() if "head" in n], lr=0.01)
    return dmp, head


def _batches(rows: int, batch: int, pooling: int, rank: int, count: int = 4) -> list[KeyedJaggedTensor]:
    out = []
    for seed in range(count):
        generator = torch.Generator().manual_seed(seed * 31 + rank)
        values = (torch.rand(batch * pooling, generator=generator).pow(2) * rows).long()
        out.append(KeyedJaggedTensor.from_lengths_sync(
            keys=["f0"], values=values, lengths=torch.full((batch,), pooling, dtype=torch.long)))
    return out


def _time(rank: int, world_size: int, quick: bool, peers: tuple[str, ...], warmup: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    rows, batch, pooling = _sizes(quick)
    batches = _batches(rows, batch, pooling, rank)
    return time_peers({p: _stepper(*_build(p, rows, world_size), batches) for p in peers}, warmup, repeats)


def _memory(rank: int, world_size: int, peer: str, quick: bool, steps: int) -> int:
    torch.set_num_threads(1)
    rows, batch, pooling = _sizes(quick)
    step = _stepper(*_build(peer, rows, world_size), _batches(rows, batch, pooling, rank))
    for _ in range(steps):
        step()
    return own_peak_rss_kib()


def run(quick: bool) -> dict:
    """Measure; returns a JSON-able result with ratios."""
    rows, batch, pooling = _sizes(quick)
    warmup, repeats, steps = (1, 3, 2) if quick else (2, 10, 3)
    memory = peak_rss_kib(_memory, list(ADAM), quick, steps, quick=quick, timeout=1800)
    adam = on_ranks(_time, quick, ADAM, warmup, repeats, quick=quick, timeout=1800)[0]
    # Its steps take ~10 ms, their spread (p25-p75) half the median at 10 repeats: 5x as many
    rowwise = on_ranks(_time, quick, ROWWISE, warmup, repeats * 5, quick=quick, timeout=1800)[0]
    median = {peer: t["median_s"] for peer, t in {**adam, **rowwise}.items()}
    ratios = {
        "peak RSS fp16_bf16 / fp32: FP16 weights, BF16 state (about 0.5)": memory["fp16_bf16"] / memory["fp32"],
        "peak RSS fp16 / fp32: FP16 weights, float32 state (about 0.83)": memory["fp16"] / memory["fp32"],
        "step time fp16_bf16 / fp32": median["fp16_bf16"] / median["fp32"],
        "step time fp16 / fp32": median["fp16"] / median["fp32"],
        "step time ours / stock TorchRec, row-wise Adagrad on FP16 (target <= 1.05)":
            median["ours_rowwise_fp16"] / median["stock_rowwise_fp16"],
        "step time ours fallback / stock TorchRec, row-wise Adagrad on FP16":
            median["fallback_rowwise_fp16"] / median["stock_rowwise_fp16"],
    }
    return {
        "setup": {"ranks": 2, "rows": rows, "dim": DIM, "batch_per_rank": batch, "pooling": pooling,
                  "adam": "row_wise, fallback", "rowwise": "table_wise", "repeats": repeats},
        "timings": {**adam, **rowwise},
        "ratios": ratios,
        "peak_rss_kib": memory,
    }
