"""The demo's DLRM on synthetic Criteo-shaped data, for scale experiments (not part of ``make demo``).

    python examples/synthetic_criteo.py [--rows 100000] [--steps 100] [--batch-size 512] [--world-size 2]

Criteo's shape: 13 dense features and 26 categorical ones, one table each.
``--rows`` sets every table's size (one number), or each (26 comma-separated
numbers). Ids follow a Zipf-like law, as real ids do, and the label a fixed
random rule of the features, so the loss falls. Tables of at least
``--id-rows`` rows get row-wise Adagrad (fused), smaller ones SGD (fused), the
first table Adam (the fallback), the MLPs AdamW (the DDP comm hook). It prints
the sharding, the loss, and samples per second per rank.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quiet  # noqa: E402

quiet.install()  # before torch: the ranks torchrun starts run this too

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchrec.datasets.utils import Batch  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402
from tqdm import tqdm  # noqa: E402

import dlrm  # noqa: E402
import launch  # noqa: E402

DENSE, SPARSE = 13, 26


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="100000", help="rows of every table, or 26 comma-separated sizes")
    parser.add_argument("--id-rows", type=int, default=10_000, help="tables this big get row-wise Adagrad")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=512, help="per rank")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows takes integers, got {args.rows!r}")
    if len(rows) == 1:
        rows *= SPARSE
    if len(rows) != SPARSE or min(rows) < 1:
        parser.error(f"--rows takes one size or {SPARSE} sizes, each at least 1; got {args.rows!r}")
    for name in ("steps", "batch_size", "world_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    args.sizes = {f"c{i}": n for i, n in enumerate(rows)}
    return args


class Synthetic:
    """Batches with Zipf-like ids and a label from a fixed random rule; the same on every run."""

    def __init__(self, sizes: dict[str, int], seed: int = 0) -> None:
        self.sizes = sizes
        generator = torch.Generator().manual_seed(seed)
        self.dense_weight = torch.randn(DENSE, generator=generator)
        self.id_weight = {f: torch.randn(min(n, 1000), generator=generator) for f, n in sizes.items()}

    def batch(self, size: int, step: int, rank: int) -> Batch:
        generator = torch.Generator().manual_seed(step * 1009 + rank)
        dense = torch.randn(size, DENSE, generator=generator)
        logit = dense @ self.dense_weight
        values = []
        for feature, rows in self.sizes.items():
            ids = (torch.rand(size, generator=generator).pow(3) * rows).long().clamp(max=rows - 1)
            logit = logit + self.id_weight[feature][ids % len(self.id_weight[feature])]
            values.append(ids)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=list(self.sizes), values=torch.cat(values), lengths=torch.ones(size * SPARSE, dtype=torch.long)
        )
        labels = (logit + torch.randn(size, generator=generator) > 0).float()
        return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


def run_rank(args: argparse.Namespace) -> None:
    import overlap_optim
    import sharders
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = dlrm.build(args.sizes, DENSE)
    names = list(args.sizes)
    parts = {
        "bag": names[:1],
        "ids": [f for f in names[1:] if args.sizes[f] >= args.id_rows],
        "categorical": [f for f in names[1:] if args.sizes[f] < args.id_rows],
    }
    dlrm.annotate(model, {part: features for part, features in parts.items() if features})
    sharder = sharders.EmbeddingBagCollectionSharder()
    topology = Topology(world_size=world, compute_device="cpu", local_world_size=world)
    plan = EmbeddingShardingPlanner(topology=topology).collective_plan(model, [sharder], dist.group.WORLD)
    model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                     data_parallel_wrapper=sharders.DataParallelWrapper())
    table = sharders.describe(model)
    optimizer = overlap_optim.get_optimizers(model)
    data = Synthetic(args.sizes)
    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
    batches = (data.batch(args.batch_size, step, rank) for step in range(args.steps))
    if rank == 0:
        print(f"{world} ranks, tables of {min(args.sizes.values())}-{max(args.sizes.values())} rows:\n{table}", flush=True)
    losses, started = [], time.perf_counter()
    for _ in tqdm(range(args.steps), desc="steps", disable=rank != 0):
        loss, _, _ = pipeline.progress(batches)
        losses.append(float(loss))
    elapsed = time.perf_counter() - started
    if rank == 0:
        head = sum(losses[:10]) / len(losses[:10])
        tail = sum(losses[-10:]) / len(losses[-10:])
        print(f"loss {head:.4f} (first 10 steps) -> {tail:.4f} (last 10); "
              f"{args.steps * args.batch_size / elapsed:,.0f} samples/s per rank", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if launch.under_torchrun():
        return launch.run_rank(run_rank, args)
    return launch.relaunch(__file__, list(argv if argv is not None else sys.argv[1:]), args.world_size)


if __name__ == "__main__":
    sys.exit(main())
