"""A sequential recommender on MovieLens-100k, an EmbeddingCollection trained on 2 ranks with per-table optimizers.

    python examples/sequential.py [--epochs 5] [--batch-size 256] [--world-size 2] [--out demo_out]
                                  [--max-len 20] [--negatives 100] [--data-dir DIR] [--limit N]

Run as above, it fetches the data (see examples/sequential_data.py), launches
``--world-size`` ranks with torchrun (gloo, CPU), then trains the same model in
this one process with plain torch.optim (same initial weights, same global
batches in the same order, same negatives) as the baseline. It prints the
hit rate at 10 (HR@10) of both on the held-out users and how closely the two
runs agree, and plots both into ``<out>/sequential.png``. It exits with 1 when
the two HR@10 differ by more than :data:`HR_BAR`.

The model reads a user's last ``--max-len`` items through one
``EmbeddingCollection`` (EC: one row per id, unpooled): each item's row is
scaled, dimension by dimension, by ``1 +`` the row of its position (its
recency) in a second table, the rows are averaged, and a small residual MLP
makes the user vector. The candidates (the next item, then ``--negatives``
items drawn uniformly, never the next item) are looked up through the same EC,
as a second feature of the item table; the scores are the dot products, and the
loss the cross entropy of the next item against the negatives (a sampled
softmax). No output layer is tied to a sharded table.

Each part has its own optimizer, said once with ``apply_optimizer_in_backward``
(see :data:`OPTIMIZERS`): the item table (row_wise) runs FBGEMM's fused row-wise
Adagrad, the position table (table_wise) torch.optim's Adam in our fallback
kernel with dense semantics (``dense_tables``: untouched rows step too, as dense
torch.optim does), and the MLP AdamW from our DDP comm hook. Each rank shards
the model with ``sharders.EmbeddingCollectionSharder`` under
``DistributedModelParallel`` and drives a linear LR decay through
``overlap_optim.get_optimizers``.

Sharded training is exact, up to float rounding: the ranks sum each global
batch's gradients in another order than one process does. On MovieLens-100k (5
epochs) the two loss curves agree within 5e-7 for the first 423 steps of 770;
then they part, and the weights end about 0.1 apart. At step 423 the weights
differ by at most 4e-6, but one sample's ReLU input in the MLP sits at 1e-7 and
switches sides, so the gradient of an item row that sample reads changes by 1.3%,
and row-wise Adagrad's small accumulator for that rarely seen row makes it a
large step. Recomputed in one process from the ranks' own weights, that row's
gradient is the ranks' to 5e-8: the updates are exact, the trajectory is
sensitive (a one-process run drifts from itself the same way when its batch's
loss is only summed in two halves, as the ranks do). HR@10 is the check that
matters, and it agrees.

HR@10 (leave-last-out): each held-out user's last item, ranked by the model
against 100 items that user never rated (fixed by seed), is a hit when fewer
than 10 of them score higher.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quiet  # noqa: E402

quiet.install()  # before torch: the ranks torchrun starts run this too

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed._shard.sharded_tensor import ShardedTensor  # noqa: E402
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad  # noqa: E402
from tqdm import tqdm  # noqa: E402

import launch  # noqa: E402
import movielens_data  # noqa: E402
import sequential_data  # noqa: E402

DIM = 32
HR_BAR = 0.01  # |HR@10 - baseline HR@10|
SAME_LOSS = 1e-5  # two per-step losses this close count as the same step
TOP_K = 10
# part -> (optimizer class, kwargs)
OPTIMIZERS = {
    # fused EXACT_ROWWISE_ADAGRAD; lazy = dense for it. Row-wise, the usual choice for recommendation tables:
    # elementwise Adagrad's first step on a row is lr * sign(g), so a coordinate whose summed gradient nearly
    # cancels moves by a full step either way, and two exact runs that round differently drift apart sooner.
    "item": (RowWiseAdagrad, {"lr": 0.5, "eps": 1e-8}),
    "position": (torch.optim.Adam, {"lr": 0.03}),  # not fusable on CPU: the fallback, dense semantics
    "dense": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 1e-4}),  # from the DDP comm hook
}
SHARDING = {"item": "row_wise", "position": "table_wise"}
# Adam keeps moving rows with momentum after the batch stops touching them, and the baseline is dense
# torch.optim: the position table steps every row (every position is in nearly every batch anyway).
DENSE_TABLES = ("position",)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    movielens_data.add_run_arguments(parser)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N ratings (smoke tests)")
    parser.add_argument("--max-len", type=int, default=20, help="history length: the last L items before the target")
    parser.add_argument("--negatives", type=int, default=100, help="sampled negatives per target, in training and HR@10")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "world_size", "max_len", "negatives"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def load(args: argparse.Namespace) -> sequential_data.Sequences:
    return sequential_data.load(args.data_dir, max_len=args.max_len, negatives=args.negatives, limit=args.limit)


# -- the model, its optimizers and the data order, shared by the ranks and the baseline --

class NextItemModel(nn.Module):
    """Scores ``1 + negatives`` candidates per sample from the user's recent items (see the module doc).

    ``forward(kjt)`` takes the features of :data:`sequential_data.FEATURES` and returns the scores,
    ``[batch, candidates]``; the next item is candidate 0.
    """

    def __init__(self, item_count: int, max_len: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name="item", embedding_dim=DIM, num_embeddings=item_count,
                            feature_names=["history", "candidates"]),
            EmbeddingConfig(name="position", embedding_dim=DIM, num_embeddings=max_len, feature_names=["position"]),
        ], device=torch.device("cpu"))
        self.mlp = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, DIM))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        rows = self.ec(kjt)
        history, candidates = rows["history"], rows["candidates"]
        lengths = history.lengths()
        scaled = history.values() * (1 + rows["position"].values())
        sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        mean = scaled.new_zeros(lengths.numel(), DIM).index_add(0, sample, scaled) / lengths[:, None].clamp(min=1)
        user = mean + self.mlp(mean)
        return torch.einsum("bd,bkd->bk", user, candidates.values().view(lengths.numel(), -1, DIM))


def _parts(model: NextItemModel) -> dict[str, list[nn.Parameter]]:
    return {"item": [model.ec.embeddings["item"].weight], "position": [model.ec.embeddings["position"].weight],
            "dense": list(model.mlp.parameters())}


def loss_of(scores: torch.Tensor) -> torch.Tensor:
    """Sampled softmax: the cross entropy of the next item (candidate 0) against the negatives."""
    return nn.functional.cross_entropy(scores, scores.new_zeros(scores.shape[0], dtype=torch.long))


def linear_decay(total_steps: int):
    """The LR factor: 1 at the first step, down to 0.1 at the last."""
    return lambda step: 1 - 0.9 * min(step, total_steps) / max(1, total_steps)


def global_batches(data: sequential_data.Sequences, epoch: int, global_size: int, negatives: int):
    """Each epoch's training samples, shuffled, in global batches of ``global_size`` (the last partial
    one dropped), each with its negatives: ``[(samples, negatives)]``, the same on every rank."""
    order = data.train[torch.randperm(data.train.numel(), generator=torch.Generator().manual_seed(1000 + epoch))]
    out = []
    for step in range(order.numel() // global_size):
        samples = order[step * global_size : (step + 1) * global_size]
        seed = 10_000 * (epoch + 1) + step
        out.append((samples, sequential_data.training_negatives(data.items[samples], negatives, data.item_count, seed)))
    return out


def hits(scores: torch.Tensor) -> torch.Tensor:
    """Per sample: the next item (candidate 0) ranks in the top :data:`TOP_K` (fewer than K score higher)."""
    return (scores[:, 1:] > scores[:, :1]).sum(1) < TOP_K


# -- the distributed run (one process per rank, started by torchrun) --

def _copy_initial_tables(model: nn.Module, initial: dict[str, torch.Tensor]) -> None:
    """Start every local shard from the unsharded model's weights, whatever the sharded kernels were given."""
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if key not in initial or ".embeddings." not in key:
                continue
            if hasattr(value, "local_shards"):
                for shard in value.local_shards():
                    (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(initial[key][row : row + rows, col : col + cols])
            else:
                value.copy_(initial[key])


def _gather_weights(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on rank 0 (None elsewhere); a collective."""
    rank, out = dist.get_rank(), {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):  # a table: its shards sit on one rank or several
            full = torch.empty(value.size()) if rank == 0 else None
            value.gather(0, full)
            out[key] = full
        else:
            out[key] = value.detach().clone()
    return out if rank == 0 else None


def _evaluate(model: nn.Module, data: sequential_data.Sequences, batch_size: int, rank: int, world: int) -> float:
    """HR@10 on the held-out users, split over the ranks (each rank's share padded to the same
    size with copies of the first user, whose results are dropped)."""
    share = -(-data.held_out.numel() // world)
    index = torch.arange(rank * share, (rank + 1) * share)
    valid = index < data.held_out.numel()
    index = torch.where(valid, index, 0)
    found = []
    model.eval()
    with torch.no_grad():
        for chunk in index.split(batch_size):
            found.append(hits(model(data.batch(data.held_out[chunk], data.held_out_negatives[chunk]))))
    model.train()
    count = torch.tensor([float(torch.cat(found)[valid].sum())])
    dist.all_reduce(count)
    return float(count) / data.held_out.numel()


def run_rank(args: argparse.Namespace) -> None:
    import overlap_optim
    import sharders
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load(args)
    global_size = args.batch_size * world
    steps = data.train.numel() // global_size
    model = NextItemModel(data.item_count, args.max_len)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for part, params in _parts(model).items():
        overlap_optim.apply_optimizer_in_backward(OPTIMIZERS[part][0], params, OPTIMIZERS[part][1])
    sharder = sharders.EmbeddingCollectionSharder(dense_tables=DENSE_TABLES)
    topology = Topology(world_size=world, compute_device="cpu", local_world_size=world)
    constraints = {t: ParameterConstraints(sharding_types=[s]) for t, s in SHARDING.items()}
    plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
        model, [sharder], dist.group.WORLD)
    model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                     data_parallel_wrapper=sharders.DataParallelWrapper())
    _copy_initial_tables(model, initial)
    table = sharders.describe(model)
    optimizer = overlap_optim.get_optimizers(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [linear_decay(steps * args.epochs)] * len(optimizer.param_groups))
    if rank == 0:
        print(f"{world} ranks; {data.train.numel()} training samples, {data.held_out.numel()} held-out users, "
              f"{data.item_count} items; the sharded model:\n{table}", flush=True)
    history, started = [], time.perf_counter()
    for epoch in range(args.epochs):
        losses = []
        batches = global_batches(data, epoch, global_size, args.negatives)
        for samples, negatives in tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", disable=rank != 0, leave=False):
            mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
            loss = loss_of(model(data.batch(samples[mine], negatives[mine])))
            loss.backward()  # steps every part: the tables in their kernels, the MLP in the DDP hook
            optimizer.step()  # a no-op here: every parameter stepped in backward
            scheduler.step()
            losses.append(loss.item())
        # each rank's mean over an equal share: their average is the global batch's loss
        losses = torch.tensor(losses)
        dist.all_reduce(losses)
        history.append({"epoch": epoch + 1, "loss": (losses / world).tolist(),
                        "hr": _evaluate(model, data, args.batch_size, rank, world)})
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: train loss {sum(history[-1]['loss']) / steps:.4f}, "
                  f"held-out HR@{TOP_K} {history[-1]['hr']:.4f}", flush=True)
    seconds = time.perf_counter() - started
    weights = _gather_weights(model)
    if rank == 0:
        torch.save(weights, args.out / "sequential_weights.pt")
        (args.out / "sequential.json").write_text(json.dumps({"history": history, "seconds": seconds}, indent=1))
    dist.destroy_process_group()


# -- the baseline: one process, plain torch.optim on the global batches --

def run_baseline(args: argparse.Namespace, data: sequential_data.Sequences) -> tuple[dict, dict[str, torch.Tensor]]:
    global_size = args.batch_size * args.world_size
    steps = data.train.numel() // global_size
    model = NextItemModel(data.item_count, args.max_len)
    optimizers = [OPTIMIZERS[part][0](params, **OPTIMIZERS[part][1]) for part, params in _parts(model).items()]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, linear_decay(steps * args.epochs)) for o in optimizers]
    history, started = [], time.perf_counter()
    for epoch in range(args.epochs):
        losses = []
        batches = global_batches(data, epoch, global_size, args.negatives)
        for samples, negatives in tqdm(batches, desc=f"baseline epoch {epoch + 1}/{args.epochs}", leave=False):
            loss = loss_of(model(data.batch(samples, negatives)))
            loss.backward()
            for opt, sched in zip(optimizers, schedulers):
                opt.step()
                opt.zero_grad()
                sched.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            found = [hits(model(data.batch(data.held_out[c], data.held_out_negatives[c])))
                     for c in torch.arange(data.held_out.numel()).split(global_size)]
        model.train()
        history.append({"epoch": epoch + 1, "loss": losses, "hr": float(torch.cat(found).float().mean())})
    run = {"history": history, "seconds": time.perf_counter() - started}
    return run, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _losses(run: dict) -> list[float]:
    return [loss for h in run["history"] for loss in h["loss"]]


def plot(ours: dict, baseline: dict, path: Path) -> None:
    """Per-step train loss of both runs, their difference, and HR@10 per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    runs = (("ours (2 ranks, EC sharded, in-backward)", ours, "-", "o-"),
            ("baseline (1 process, torch.optim)", baseline, "--", "s--"))
    for label, run, line, marks in runs:
        losses = _losses(run)
        left.plot(range(1, len(losses) + 1), losses, line, linewidth=1, label=label)
        right.plot([h["epoch"] for h in run["history"]], [h["hr"] for h in run["history"]], marks, label=label)
    gaps = [abs(a - b) for a, b in zip(_losses(ours), _losses(baseline))]
    middle.plot(range(1, len(gaps) + 1), [max(g, 1e-8) for g in gaps], linewidth=0.8, color="tab:red")
    left.set(title="train loss (sampled softmax) per step", xlabel="step")
    middle.set(title="|ours - baseline| per step (floor 1e-8)", xlabel="step", yscale="log")
    right.set(title=f"held-out HR@{TOP_K} (last item vs 100 unrated)", xlabel="epoch")
    for axis in (left, middle, right):
        axis.grid(alpha=0.3)
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(ours: dict, baseline: dict, ours_weights: dict, baseline_weights: dict) -> bool:
    """Print ours against the baseline; True when their HR@10 agree within :data:`HR_BAR`."""
    gaps = [abs(a - b) for a, b in zip(_losses(ours), _losses(baseline))]
    same = next((i for i, g in enumerate(gaps) if g > SAME_LOSS), len(gaps))
    weights = max((ours_weights[k] - v).abs().max().item() for k, v in baseline_weights.items())
    hr, ref = ours["history"][-1]["hr"], baseline["history"][-1]["hr"]
    print(f"\nheld-out HR@{TOP_K}: ours {hr:.4f} (2 ranks, {ours['seconds']:.1f} s of training) | "
          f"baseline {ref:.4f} (1 process, plain torch.optim, {baseline['seconds']:.1f} s)")
    print(f"difference {abs(hr - ref):.4f}: {'within' if abs(hr - ref) <= HR_BAR else 'NOT within'} the {HR_BAR} bar")
    print(f"per-step train loss: the same (within {SAME_LOSS:g}) for the first {same} of {len(gaps)} steps, "
          f"largest difference {max(gaps, default=0.0):.2g}; largest weight difference at the end: {weights:.3g}")
    return abs(hr - ref) <= HR_BAR


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if launch.under_torchrun():
        return launch.run_rank(run_rank, args)
    try:
        args.data_dir = movielens_data.fetch(args.cache_dir, args.data_dir)
        data = load(args)  # a data error here, once, rather than in every rank
    except (movielens_data.DataUnavailable, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if data.train.numel() < args.batch_size * args.world_size:
        print(f"error: {data.train.numel()} training samples, fewer than one global batch of "
              f"{args.world_size} x {args.batch_size}; lower --batch-size", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    forwarded = list(argv if argv is not None else sys.argv[1:]) + ["--data-dir", str(args.data_dir)]
    if launch.relaunch(__file__, forwarded, args.world_size) != 0:
        print("error: the distributed run failed (see above)", file=sys.stderr)
        return 1
    ours = json.loads((args.out / "sequential.json").read_text())
    ours_weights = torch.load(args.out / "sequential_weights.pt")
    # one thread, as each rank has (launch.relaunch): on a busy machine a second OpenMP thread only waits
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    baseline, baseline_weights = run_baseline(args, data)
    (args.out / "sequential_baseline.json").write_text(json.dumps(baseline, indent=1))
    plot(ours, baseline, args.out / "sequential.png")
    ok = report(ours, baseline, ours_weights, baseline_weights)
    print(f"curves: {args.out / 'sequential.png'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
