"""The main example: a DLRM on MovieLens-100k (rating >= 4), trained on 2 ranks with per-part optimizers.

    python examples/movielens.py [--epochs 5] [--batch-size 256] [--world-size 2] [--out demo_out] [--resume]

Run as above, it fetches the data (see examples/movielens_data.py), launches
``--world-size`` ranks with torchrun (gloo, CPU), then trains the same model in
this one process with plain torch.optim (same settings, same data order) as the
baseline, plots both into ``<out>/curves.png`` and compares their test AUC.

Each rank shards the model with ``sharders.EmbeddingBagCollectionSharder`` and
``sharders.DataParallelWrapper`` under ``DistributedModelParallel``, trains with
TorchRec's ``TrainPipelineSparseDist``, and drives the LR schedule through
``overlap_optim.get_optimizers``. Every epoch it reports the train loss and the
validation AUC and log-loss, and saves a checkpoint (``--resume`` continues from
the latest).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchmetrics.functional.classification import binary_auroc  # noqa: E402
from tqdm import tqdm  # noqa: E402

import dlrm  # noqa: E402
import launch  # noqa: E402
import movielens_data  # noqa: E402

PARTS = {"ids": ["user", "item"], "categorical": ["age", "gender", "occupation", "zip"], "bag": ["genre"]}
# Each part where it shows a different path: fused row-wise, fused table-wise, the fallback.
SHARDING = {"ids": "row_wise", "categorical": "table_wise", "bag": "table_wise"}
QUALITY_BAR = 0.005  # |test AUC - baseline test AUC|


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256, help="per rank; the global batch is world x this")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    parser.add_argument("--data-dir", type=Path, default=None, help=f"a directory holding {list(movielens_data.FILES)}")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "overlap-optim")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in <out>/ckpt")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N ratings (smoke tests)")
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "world_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


# -- data order, shared by the ranks and the baseline --

def global_batches(data, split: str, epoch: int, global_size: int, shuffle: bool) -> list[torch.Tensor]:
    """The split's samples in global batches of ``global_size`` (the last partial one dropped)."""
    index = data.splits[split]
    if shuffle:
        index = index[torch.randperm(index.numel(), generator=torch.Generator().manual_seed(1000 + epoch))]
    count = index.numel() // global_size
    return [index[i * global_size : (i + 1) * global_size] for i in range(count)]


def metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    return {"auc": float(binary_auroc(torch.sigmoid(logits), labels.long())), "logloss": float(loss)}


# -- the distributed run (one process per rank, started by torchrun) --

def _copy_initial_tables(model, initial: dict[str, torch.Tensor]) -> None:
    """Start every local shard from the unsharded model's weights (the baseline starts there too)."""
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if key not in initial or "embedding_bags" not in key:
                continue
            full = initial[key]
            if hasattr(value, "local_shards"):
                for shard in value.local_shards():
                    (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(full[row : row + rows, col : col + cols])
            else:
                value.copy_(full)


def _evaluate(model, data, split: str, args, rank: int, world: int) -> dict[str, float]:
    model.eval()
    logits, labels = [], []
    with torch.no_grad():
        for index in global_batches(data, split, 0, args.batch_size * world, shuffle=False):
            batch = data.batch(index[rank * args.batch_size : (rank + 1) * args.batch_size])
            _, (_, out, target) = model(batch)
            logits.append(out.view(-1))
            labels.append(target.view(-1))
    model.train()
    parts: list = [None] * world
    dist.all_gather_object(parts, (torch.cat(logits), torch.cat(labels)))
    return metrics(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))


def run_rank(args: argparse.Namespace) -> None:
    import overlap_optim
    import sharders
    from overlap_optim import checkpoint
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = movielens_data.load(args.data_dir, limit=args.limit)
    model = dlrm.build(data.sizes, len(movielens_data.DENSE))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dlrm.annotate(model, PARTS)
    sharder = sharders.EmbeddingBagCollectionSharder()
    topology = Topology(world_size=world, compute_device="cpu", local_world_size=world)
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=[SHARDING[part]]) for part, fs in PARTS.items() for f in fs}
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                     data_parallel_wrapper=sharders.DataParallelWrapper())
    _copy_initial_tables(model, initial)
    table = sharders.describe(model)
    optimizer = overlap_optim.get_optimizers(model)
    steps = len(global_batches(data, "train", 0, args.batch_size * world, shuffle=True))
    schedule = dlrm.warmup_then_decay(steps * args.epochs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [schedule] * len(optimizer.param_groups))
    ckpt, history, start = args.out / "ckpt", [], 0
    if args.resume and checkpoint.latest(ckpt) is not None:
        extras = checkpoint.load(ckpt, model, optimizer, {"scheduler": scheduler})
        start, history = extras["step"], list(extras["history"])
    if rank == 0:
        print(f"{world} ranks; the sharded model:\n{table}", flush=True)
        if start:
            print(f"resumed from {checkpoint.latest(ckpt).name}: epoch {start} of {args.epochs} done", flush=True)
    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
    for epoch in range(start, args.epochs):
        batches = global_batches(data, "train", epoch, args.batch_size * world, shuffle=True)
        local = (data.batch(b[rank * args.batch_size : (rank + 1) * args.batch_size]) for b in batches)
        losses = []
        bar = tqdm(total=len(batches), desc=f"epoch {epoch + 1}/{args.epochs}", disable=rank != 0, leave=False)
        pipeline.reset()
        while True:
            try:
                loss, _, _ = pipeline.progress(local)
            except StopIteration:
                break
            scheduler.step()
            losses.append(float(loss.detach().mean()))
            bar.update()
        bar.close()
        pipeline.detach()
        train_loss = torch.tensor([sum(losses) / max(1, len(losses))])
        dist.all_reduce(train_loss)
        val = _evaluate(model, data, "val", args, rank, world)
        history.append({"epoch": epoch + 1, "train_loss": float(train_loss) / world, "val_auc": val["auc"],
                        "val_logloss": val["logloss"]})
        checkpoint.save(ckpt, model, optimizer, {"scheduler": scheduler, "step": epoch + 1, "history": history})
        if rank == 0:
            h = history[-1]
            print(f"epoch {h['epoch']}/{args.epochs}: train loss {h['train_loss']:.4f}, "
                  f"val AUC {h['val_auc']:.4f}, val log-loss {h['val_logloss']:.4f}", flush=True)
    test = _evaluate(model, data, "test", args, rank, world)
    if rank == 0:
        (args.out / "ours.json").write_text(json.dumps({"history": history, "test": test}, indent=1))
    dist.destroy_process_group()


# -- the baseline: one process, plain torch.optim --

def run_baseline(args: argparse.Namespace) -> dict:
    data = movielens_data.load(args.data_dir, limit=args.limit)
    model = dlrm.build(data.sizes, len(movielens_data.DENSE))
    optimizers = dlrm.reference_optimizers(model, PARTS)
    global_size = args.batch_size * args.world_size
    steps = len(global_batches(data, "train", 0, global_size, shuffle=True))
    schedule = dlrm.warmup_then_decay(steps * args.epochs)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in optimizers]

    def evaluate(split: str) -> dict[str, float]:
        model.eval()
        with torch.no_grad():
            outs = [model(data.batch(b))[1] for b in global_batches(data, split, 0, global_size, shuffle=False)]
        model.train()
        return metrics(torch.cat([o[1].view(-1) for o in outs]), torch.cat([o[2].view(-1) for o in outs]))

    history = []
    for epoch in range(args.epochs):
        losses = []
        for index in tqdm(global_batches(data, "train", epoch, global_size, shuffle=True),
                          desc=f"baseline epoch {epoch + 1}/{args.epochs}", leave=False):
            loss, _ = model(data.batch(index))
            loss.backward()
            for opt, sched in zip(optimizers, schedulers):
                opt.step()
                opt.zero_grad()
                sched.step()
            losses.append(loss.item())
        val = evaluate("val")
        history.append({"epoch": epoch + 1, "train_loss": sum(losses) / max(1, len(losses)),
                        "val_auc": val["auc"], "val_logloss": val["logloss"]})
    return {"history": history, "test": evaluate("test")}


def plot(ours: dict, baseline: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    runs = [("ours (2 ranks, in-backward)", ours, "o-")]
    if baseline is not None:
        runs.append(("baseline (1 process, torch.optim)", baseline, "s--"))
    for label, run, style in runs:
        epochs = [h["epoch"] for h in run["history"]]
        left.plot(epochs, [h["train_loss"] for h in run["history"]], style, label=label)
        right.plot(epochs, [h["val_auc"] for h in run["history"]], style, label=label)
    left.set(title="train loss", xlabel="epoch")
    right.set(title="validation AUC", xlabel="epoch")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if launch.under_torchrun():
        run_rank(args)
        return 0
    try:
        args.data_dir = movielens_data.fetch(args.cache_dir, args.data_dir)
    except movielens_data.DataUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    forwarded = list(argv if argv is not None else sys.argv[1:]) + ["--data-dir", str(args.data_dir)]
    if launch.relaunch(__file__, forwarded, args.world_size) != 0:
        print("error: the distributed run failed (see above)", file=sys.stderr)
        return 1
    ours = json.loads((args.out / "ours.json").read_text())
    baseline = None if args.no_baseline else run_baseline(args)
    plot(ours, baseline, args.out / "curves.png")
    print(f"\ntest AUC {ours['test']['auc']:.4f} (log-loss {ours['test']['logloss']:.4f})")
    if baseline is None:
        print(f"curves: {args.out / 'curves.png'}")
        return 0
    diff = abs(ours["test"]["auc"] - baseline["test"]["auc"])
    (args.out / "baseline.json").write_text(json.dumps(baseline, indent=1))
    print(f"baseline test AUC {baseline['test']['auc']:.4f} (one process, plain torch.optim, same data order)")
    verdict = "within" if diff <= QUALITY_BAR else "NOT within"
    print(f"difference {diff:.4f}: {verdict} the {QUALITY_BAR} quality bar; curves: {args.out / 'curves.png'}")
    return 0 if diff <= QUALITY_BAR else 1


if __name__ == "__main__":
    sys.exit(main())
