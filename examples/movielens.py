"""The main example: a DLRM on MovieLens-100k (rating >= 4), trained on 2 ranks with per-part optimizers.

    python examples/movielens.py [--epochs 5] [--batch-size 256] [--world-size 2] [--out demo_out] [--resume]
                                 [--local-sgd qsr [--qsr-alpha A] [--qsr-base-period H] [--qsr-warmup N]]

Run as above, it fetches the data (see examples/movielens_data.py), launches
``--world-size`` ranks with torchrun (gloo, CPU), then trains the same model in
this one process with plain torch.optim (same settings, same data order) as the
baseline, plots both into ``<out>/curves.png`` and compares their test AUC.

Both runs clip the gradients of the MLPs (the dense part; not the tables) to a
global 2-norm of ``MAX_NORM``: the ranks with ``overlap_optim.apply_gradient_clipping``,
declared on the unsharded model, so every in-backward update of the MLPs uses the
clipped gradient; the baseline with ``torch.nn.utils.clip_grad_norm_`` after
``backward()``. The progress bars show that norm (before clipping), and
``<out>/grad_norm.png`` plots it step by step for both runs.

Each rank shards the model with ``sharders.EmbeddingBagCollectionSharder`` and
``sharders.DataParallelWrapper`` under ``DistributedModelParallel``, trains with
TorchRec's ``TrainPipelineSparseDist``, and drives the LR schedule through
``overlap_optim.get_optimizers``. Every epoch it reports the train loss and the
validation AUC and log-loss, and saves a checkpoint (``--resume`` continues from
the latest).

With ``--local-sgd qsr`` it then trains the same ranks again with local SGD on the
dense part (``overlap_optim.QSR`` through ``DataParallelWrapper(local_sgd=...)``:
each rank steps its dense layers on its own gradient for ``H`` steps, then the ranks
average them; the Quadratic Synchronization Rule sets ``H = max(base_period,
floor((alpha / lr) ** 2))`` from the dense lr, so rounds grow as the lr decays). The
sharded tables stay synchronous. It compares that run's test AUC and its dense
all-reduces (count and bytes per rank, during the training steps) with the
synchronous run's, and plots ``H`` and the lr over the steps into ``<out>/qsr.png``.
The ranks average before each evaluation and checkpoint (every epoch), and the
last round ends on the last step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quiet  # noqa: E402

quiet.install()  # before torch: the ranks torchrun starts run this too

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
MAX_NORM = 1.0  # both runs clip the MLPs' gradients to this global 2-norm (torch's usual value)
# Local SGD (QSR) on the dense part, against the synchronous 2-rank run:
QSR_AUC_BAR = 0.003  # |test AUC - synchronous test AUC|
QSR_BYTES_BAR = 4.0  # at least this many times fewer dense all-reduce bytes
# The dense lr (AdamW) warms up to 0.002 over 50 steps, then decays to 0.0002. Those 50 steps run
# synchronously (the rule would give a tiny lr a huge H). Then H = 8 (the rule's term is 6.25 at the
# peak lr) until the lr falls below 0.005 / 3, growing to 625 at the final lr, though the averaging
# before each epoch's evaluation ends every round within the epoch. On this demo: test AUC within
# 0.001 of the synchronous run's, 8x fewer dense all-reduce bytes.
QSR_DEFAULTS = {"alpha": 0.005, "base_period": 8, "warmup": 50}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    movielens_data.add_run_arguments(parser)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in <out>/ckpt (and <out>/ckpt-qsr)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N ratings (smoke tests)")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--local-sgd", choices=("off", "qsr"), default="off",
                        help="qsr: also train with local SGD on the dense part (Quadratic Synchronization Rule) "
                             "and compare it with the synchronous run")
    parser.add_argument("--qsr-alpha", type=float, default=QSR_DEFAULTS["alpha"],
                        help="H = max(base period, floor((alpha / lr) ** 2)) with the dense lr")
    parser.add_argument("--qsr-base-period", type=int, default=QSR_DEFAULTS["base_period"], help="the shortest H")
    parser.add_argument("--qsr-warmup", type=int, default=QSR_DEFAULTS["warmup"],
                        help="steps run synchronously first (the lr warm-up is 50 steps)")
    args = parser.parse_args(argv)
    if args.qsr_alpha < 0 or args.qsr_warmup < 0:
        parser.error(f"--qsr-alpha and --qsr-warmup must be at least 0, got {args.qsr_alpha} and {args.qsr_warmup}")
    for name in ("epochs", "batch_size", "world_size", "qsr_base_period"):
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


class AllReduceCounter:
    """Counts the ``torch.distributed.all_reduce`` calls of this process, and their bytes, while on.

    Switched on only around the training steps (and the averagings before an
    evaluation), it sees the dense part's collectives: the DDP hook's bucket
    all-reduces on synchronous steps, the local-SGD averagings, and, on
    synchronous runs, the one all-reduce per step of the MLPs' clipping norm (8
    bytes; with local SGD each rank clips by its own norm, with no collective).
    TorchRec's sparse collectives are all-to-alls, not all-reduces.
    """

    def __init__(self) -> None:
        self.calls, self.bytes, self._on = 0, 0, False
        self._original = dist.all_reduce
        dist.all_reduce = self._all_reduce  # torch.distributed's, which the hook and QSR call

    def _all_reduce(self, tensor, *args, **kwargs):
        if self._on:
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
        return self._original(tensor, *args, **kwargs)

    @contextlib.contextmanager
    def on(self):
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def close(self) -> None:
        dist.all_reduce = self._original


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
    steps = len(global_batches(data, "train", 0, args.batch_size * world, shuffle=True))
    sync = None
    if args.local_sgd == "qsr":
        # total_steps: the last round ends on the last step, so the run ends averaged
        sync = overlap_optim.QSR(alpha=args.qsr_alpha, base_period=args.qsr_base_period,
                                 warmup_steps=args.qsr_warmup, total_steps=steps * args.epochs)
    model = dlrm.build(data.sizes, len(movielens_data.DENSE))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dlrm.annotate(model, PARTS)
    # on the unsharded model, before DMP wraps it (as the annotations): DDP's hook clips the MLPs
    clip = overlap_optim.apply_gradient_clipping(dlrm.dense_parameters(model), max_norm=MAX_NORM)
    sharder = sharders.EmbeddingBagCollectionSharder()
    topology = Topology(world_size=world, compute_device="cpu", local_world_size=world)
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=[SHARDING[part]]) for part, fs in PARTS.items() for f in fs}
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                     data_parallel_wrapper=sharders.DataParallelWrapper(local_sgd=sync))
    _copy_initial_tables(model, initial)
    table = sharders.describe(model)
    optimizer = overlap_optim.get_optimizers(model)
    schedule = dlrm.warmup_then_decay(steps * args.epochs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [schedule] * len(optimizer.param_groups))
    dense_lr = dlrm.OPTIMIZERS["dense"][1]["lr"]  # times schedule(step): the lr QSR reads at that step
    ckpt, history, start = args.out / ("ckpt" if sync is None else "ckpt-qsr"), [], 0
    stateful = {"scheduler": scheduler} if sync is None else {"scheduler": scheduler, "local_sgd": sync}
    if args.resume and checkpoint.latest(ckpt) is not None:
        extras = checkpoint.load(ckpt, model, optimizer, stateful)
        start, history = extras["step"], list(extras["history"])
    if rank == 0:
        if sync is not None:
            print(f"local SGD on the dense part: {sync}", flush=True)
        print(f"{world} ranks; the sharded model:\n{table}", flush=True)
        if start:
            print(f"resumed from {checkpoint.latest(ckpt).name}: epoch {start} of {args.epochs} done", flush=True)
    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
    counter = AllReduceCounter()
    for epoch in range(start, args.epochs):
        batches = global_batches(data, "train", epoch, args.batch_size * world, shuffle=True)
        local = (data.batch(b[rank * args.batch_size : (rank + 1) * args.batch_size]) for b in batches)
        losses, norms, lrs, periods, averaged = [], [], [], [], []
        calls, sent = counter.calls, counter.bytes
        bar = tqdm(total=len(batches), desc=f"epoch {epoch + 1}/{args.epochs}", disable=rank != 0, leave=False)
        pipeline.reset()
        while True:
            before, step = counter.calls, epoch * steps + len(losses)
            try:
                with counter.on():
                    loss, _, _ = pipeline.progress(local)
            except StopIteration:
                break
            scheduler.step()
            losses.append(float(loss.detach().mean()))
            norms.append(float(clip.total_norm))  # the MLPs' global norm before clipping, set by this backward
            if sync is not None:
                lrs.append(dense_lr * schedule(step))
                periods.append(sync.period if step >= sync.warmup_steps else 1)
                averaged.append(step >= sync.warmup_steps and counter.calls > before)
            bar.set_postfix(grad_norm=f"{norms[-1]:.3f}", refresh=False)
            bar.update()
        bar.close()
        pipeline.detach()
        if sync is not None and sync.mid_round():  # evaluate and save the averaged model
            with counter.on():
                sync.average_now()
            if averaged:
                averaged[-1] = True
        train_loss = torch.tensor([sum(losses) / max(1, len(losses))])
        dist.all_reduce(train_loss)
        val = _evaluate(model, data, "val", args, rank, world)
        history.append({"epoch": epoch + 1, "train_loss": float(train_loss) / world, "val_auc": val["auc"],
                        "val_logloss": val["logloss"], "steps": len(losses), "grad_norm": norms,
                        "dense_all_reduces": counter.calls - calls, "dense_all_reduce_bytes": counter.bytes - sent})
        if sync is not None:
            history[-1].update(lr=lrs, period=periods, averaged=averaged)
        checkpoint.save(ckpt, model, optimizer, {**stateful, "step": epoch + 1, "history": history})
        if rank == 0:
            h = history[-1]
            print(f"epoch {h['epoch']}/{args.epochs}: train loss {h['train_loss']:.4f}, "
                  f"val AUC {h['val_auc']:.4f}, val log-loss {h['val_logloss']:.4f}", flush=True)
    counter.close()
    test = _evaluate(model, data, "test", args, rank, world)
    if rank == 0:
        result = {"history": history, "test": test}
        if sync is not None:
            result["qsr"] = {"alpha": sync.alpha, "base_period": sync.base_period, "warmup_steps": sync.warmup_steps,
                             "total_steps": sync.total_steps}
        (args.out / ("ours.json" if sync is None else "qsr.json")).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


# -- the baseline: one process, plain torch.optim --

def run_baseline(args: argparse.Namespace) -> dict:
    data = movielens_data.load(args.data_dir, limit=args.limit)
    model = dlrm.build(data.sizes, len(movielens_data.DENSE))
    optimizers = dlrm.reference_optimizers(model, PARTS)
    mlps = dlrm.dense_parameters(model)
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
        losses, norms = [], []
        bar = tqdm(global_batches(data, "train", epoch, global_size, shuffle=True),
                   desc=f"baseline epoch {epoch + 1}/{args.epochs}", leave=False)
        for index in bar:
            loss, _ = model(data.batch(index))
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(mlps, MAX_NORM)))
            for opt, sched in zip(optimizers, schedulers):
                opt.step()
                opt.zero_grad()
                sched.step()
            losses.append(loss.item())
            bar.set_postfix(grad_norm=f"{norms[-1]:.3f}", refresh=False)
        val = evaluate("val")
        history.append({"epoch": epoch + 1, "train_loss": sum(losses) / max(1, len(losses)),
                        "val_auc": val["auc"], "val_logloss": val["logloss"], "steps": len(losses),
                        "grad_norm": norms})
    return {"history": history, "test": evaluate("test")}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(ours: dict, baseline: dict | None, path: Path, qsr: dict | None = None) -> None:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    runs = [("ours (2 ranks, in-backward)", ours, "o-")]
    if baseline is not None:
        runs.append(("baseline (1 process, torch.optim)", baseline, "s--"))
    if qsr is not None:
        runs.append(("ours, local SGD (QSR) on the dense part", qsr, "^:"))
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


def _norms(run: dict) -> list[float]:
    """The MLPs' gradient norm (before clipping) of a run, step by step."""
    return [n for h in run["history"] for n in h.get("grad_norm", [])]


def plot_grad_norm(ours: dict, baseline: dict | None, path: Path, qsr: dict | None = None) -> None:
    """The MLPs' global gradient norm (before clipping to MAX_NORM) per step, for each run."""
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(10, 4))
    runs = [("ours (2 ranks, in-backward; rank 0)", ours, "-")]
    if baseline is not None:
        runs.append(("baseline (1 process, torch.optim)", baseline, "--"))
    if qsr is not None:
        runs.append(("ours, local SGD (QSR): rank 0's own norm", qsr, ":"))
    for label, run, style in runs:
        norms = _norms(run)
        axis.plot(range(len(norms)), norms, style, linewidth=0.9, label=label)
    axis.axhline(MAX_NORM, color="gray", linewidth=0.8, label=f"max_norm = {MAX_NORM:g} (clipped above)")
    done = 0
    for h in ours["history"][:-1]:
        done += h.get("steps", 0)
        axis.axvline(done, color="gray", linestyle=":", linewidth=0.8)
    axis.set(title="gradient norm of the MLPs before clipping (dotted: epoch ends)", xlabel="step",
             ylabel="global 2-norm", yscale="log")
    axis.grid(alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _clipped(run: dict) -> str:
    norms = _norms(run)
    return f"clipped on {sum(n > MAX_NORM for n in norms)} of {len(norms)} steps"


def _trace(run: dict) -> tuple[list[float], list[int], list[bool]]:
    """The QSR run's lr, H and averagings, step by step."""
    lrs, periods, averaged = [], [], []
    for h in run["history"]:
        lrs += h["lr"]
        periods += h["period"]
        averaged += h["averaged"]
    return lrs, periods, averaged


def plot_qsr(run: dict, path: Path) -> None:
    """H (the local-SGD period) and the dense lr over the steps of the QSR run."""
    plt = _pyplot()
    lrs, periods, averaged = _trace(run)
    config = run["qsr"]
    steps = range(len(lrs))
    fig, left = plt.subplots(figsize=(10, 4.5))
    left.step(steps, periods, where="post", color="tab:blue", label="H (sync.period; 1 = synchronous warm-up)")
    marks = [s for s, a in zip(steps, averaged) if a]
    left.plot(marks, [periods[s] for s in marks], "|", color="tab:blue", markersize=8, alpha=0.6,
              label=f"averaging ({len(marks)})")
    left.set(xlabel="step", ylabel="H (steps per round)", yscale="log")
    right = left.twinx()
    right.plot(steps, lrs, color="tab:orange", label="dense lr (AdamW)")
    right.set(ylabel="lr", yscale="log")
    done = 0
    for h in run["history"][:-1]:
        done += h["steps"]
        left.axvline(done, color="gray", linestyle=":", linewidth=0.8)
    lines, more = left.get_legend_handles_labels(), right.get_legend_handles_labels()
    left.legend(lines[0] + more[0], lines[1] + more[1], loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3,
                fontsize=9, frameon=False)
    left.grid(alpha=0.3)
    rule = f"H = max({config['base_period']}, floor(({config['alpha']:g} / lr)²))"
    left.set_title(f"local SGD on the dense part: {rule}, synchronous for the first {config['warmup_steps']} steps\n"
                   "dotted: epoch ends (the ranks average before each evaluation); the last round ends on the last step",
                   fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _comm(run: dict) -> tuple[int, int]:
    """The dense all-reduces of a run (per rank, training steps only): count, bytes."""
    return (sum(h.get("dense_all_reduces", 0) for h in run["history"]),
            sum(h.get("dense_all_reduce_bytes", 0) for h in run["history"]))


def report_qsr(ours: dict, qsr: dict, out: Path) -> bool:
    """Print the QSR run against the synchronous one; True when it meets both bars."""
    plot_qsr(qsr, out / "qsr.png")
    config, (_, periods, averaged) = qsr["qsr"], _trace(qsr)
    (sync_calls, sync_bytes), (qsr_calls, qsr_bytes) = _comm(ours), _comm(qsr)
    diff = abs(qsr["test"]["auc"] - ours["test"]["auc"])
    fewer = sync_bytes / max(1, qsr_bytes)
    local = periods[config["warmup_steps"]:] or [0]
    print(f"\nlocal SGD on the dense part, QSR(alpha={config['alpha']:g}, base_period={config['base_period']}, "
          f"warmup_steps={config['warmup_steps']}): H from {min(local)} to {max(local)}, "
          f"{sum(averaged)} averagings in {len(periods)} steps")
    print(f"test AUC {qsr['test']['auc']:.4f} (log-loss {qsr['test']['logloss']:.4f}) against synchronous "
          f"{ours['test']['auc']:.4f}: difference {diff:.4f}, "
          f"{'within' if diff <= QSR_AUC_BAR else 'NOT within'} the {QSR_AUC_BAR} bar")
    verdict = "meets" if fewer >= QSR_BYTES_BAR else "misses"
    print(f"dense all-reduces per rank in training: synchronous {sync_calls} calls, {sync_bytes / 1e6:.2f} MB; "
          f"QSR {qsr_calls} calls, {qsr_bytes / 1e6:.2f} MB: {fewer:.1f}x fewer bytes ({verdict} the "
          f"{QSR_BYTES_BAR:g}x bar); H and lr: {out / 'qsr.png'}")
    return diff <= QSR_AUC_BAR and fewer >= QSR_BYTES_BAR


def _without_local_sgd(argv: list[str]) -> list[str]:
    """``argv`` without ``--local-sgd MODE`` (or an abbreviation argparse took for it): the parent
    says which run is which."""
    out, skip = [], False
    for arg in argv:
        name = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif len(name) >= len("--lo") and "--local-sgd".startswith(name):
            skip = "=" not in arg
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if launch.under_torchrun():
        return launch.run_rank(run_rank, args)
    try:
        args.data_dir = movielens_data.fetch(args.cache_dir, args.data_dir)
    except movielens_data.DataUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    forwarded = _without_local_sgd(list(argv if argv is not None else sys.argv[1:]))
    forwarded += ["--data-dir", str(args.data_dir)]
    # the synchronous run, then (with --local-sgd qsr) the same with local SGD on the dense part
    runs = [forwarded] if args.local_sgd == "off" else [forwarded, forwarded + ["--local-sgd", "qsr"]]
    for run in runs:
        if launch.relaunch(__file__, run, args.world_size) != 0:
            print("error: the distributed run failed (see above)", file=sys.stderr)
            return 1
    ours = json.loads((args.out / "ours.json").read_text())
    qsr = json.loads((args.out / "qsr.json").read_text()) if args.local_sgd == "qsr" else None
    baseline = None if args.no_baseline else run_baseline(args)
    plot(ours, baseline, args.out / "curves.png", qsr)
    plot_grad_norm(ours, baseline, args.out / "grad_norm.png", qsr)
    print(f"\ngradient norm of the MLPs (max_norm {MAX_NORM:g}): ours {_clipped(ours)}"
          + ("" if baseline is None else f", baseline {_clipped(baseline)}") + f"; plot: {args.out / 'grad_norm.png'}")
    print(f"test AUC {ours['test']['auc']:.4f} (log-loss {ours['test']['logloss']:.4f})")
    ok = True
    if baseline is None:
        print(f"curves: {args.out / 'curves.png'}")
    else:
        diff = abs(ours["test"]["auc"] - baseline["test"]["auc"])
        (args.out / "baseline.json").write_text(json.dumps(baseline, indent=1))
        print(f"baseline test AUC {baseline['test']['auc']:.4f} (one process, plain torch.optim, same data order)")
        verdict = "within" if diff <= QUALITY_BAR else "NOT within"
        print(f"difference {diff:.4f}: {verdict} the {QUALITY_BAR} quality bar; curves: {args.out / 'curves.png'}")
        ok = diff <= QUALITY_BAR
    if qsr is not None:
        ok = report_qsr(ours, qsr, args.out) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
