"""Soak test: a long 2-rank sharded training run whose resident memory must stay flat.

Contract: ``--steps`` (default 10,000) steps of a TorchRec model on 2 gloo ranks,
sharded by ``sharders.EmbeddingBagCollectionSharder``, with every in-backward path
of the library live at once:

- fused tables (``Adagrad``, ``RowWiseAdagrad``: FBGEMM kernels), table-wise and row-wise;
- a fallback table (``Adam``: our fallback kernel);
- a data-parallel table (``Adagrad``, updated from the DDP comm hook);
- the dense MLP (``Adam``), wrapped by ``sharders.DataParallelWrapper``;
- a ``LambdaLR`` over ``overlap_optim.get_optimizers(dmp)``, stepped after every backward;
- an ``overlap_optim.checkpoint.save`` every ``--checkpoint-every`` steps into a
  temporary directory (only the last two kept).

Each rank samples its resident set size (VmRSS) every 100 steps. The first
``--checkpoint-every`` steps are warm-up (the first checkpoint allocates). Passes
when every rank's last sample is less than 5% above its sample at the end of
warm-up; exits 1 otherwise. Prints a per-rank summary and steps/s, and writes a
plot of RSS against step per rank to ``--out``.

Run (from the repository root; takes a few minutes, not run in CI)::

    .venv/bin/python -m benchmarks.soak [--steps 10000] [--checkpoint-every 1000] [--out benchmarks/results/soak.png]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

# Known third-party noise, filtered in the parent and in each spawned rank (which imports this module):
# deprecations raised inside torch, torchrec and fbgemm_gpu, and fbgemm's dense lookup op, which has no
# autograd kernel registered (TorchRec's dense kernel, used by data-parallel tables).
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(torch|torchrec|fbgemm_gpu)(\.|$)")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|torchrec|fbgemm_gpu)(\.|$)")
warnings.filterwarnings("ignore", message=r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402

import overlap_optim  # noqa: E402
import sharders  # noqa: E402
from overlap_optim import apply_optimizer_in_backward, checkpoint  # noqa: E402
from overlap_optim.testing import run_ranks  # noqa: E402

WORLD_SIZE = 2
ROWS = 2000
DIM = 16
BATCH = 32  # samples per rank
POOL = 64  # pre-generated batches per rank, cycled
SAMPLE_EVERY = 100
MAX_GROWTH = 0.05
KEEP_CHECKPOINTS = 2
DEFAULT_OUT = "benchmarks/results/soak.png"


def _table_settings():
    """Per table: (optimizer class, kwargs, sharding type)."""
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    return {
        "fused_adagrad": (torch.optim.Adagrad, {"lr": 0.05}, "table_wise"),
        "fused_rowwise": (RowWiseAdagrad, {"lr": 0.05}, "row_wise"),
        "fallback_adam": (torch.optim.Adam, {"lr": 0.01}, "table_wise"),
        "data_parallel": (torch.optim.Adagrad, {"lr": 0.05}, "data_parallel"),
    }


class SoakModel(nn.Module):
    """One table per name (feature ``f_<name>``) and an MLP over their pooled embeddings."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.names = list(names)
        configs = [
            EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f_{n}"]) for n in names
        ]
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        self.dense = nn.Sequential(nn.Linear(len(names) * DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(kjt)
        return self.dense(torch.cat([pooled[f"f_{n}"] for n in self.names], dim=1)).squeeze(1)


def build(world_size: int) -> nn.Module:
    """The annotated model, planned with one sharding type per table and sharded by our sharder."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    settings = _table_settings()
    model = SoakModel(list(settings))
    for name, (cls, kwargs, _) in settings.items():
        apply_optimizer_in_backward(cls, model.ebc.embedding_bags[name].parameters(), kwargs)
    apply_optimizer_in_backward(torch.optim.Adam, model.dense.parameters(), {"lr": 0.001})
    sharder = sharders.EmbeddingBagCollectionSharder()
    constraints = {n: ParameterConstraints(sharding_types=[st]) for n, (_, _, st) in settings.items()}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    return DistributedModelParallel(
        model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
        data_parallel_wrapper=sharders.DataParallelWrapper(),
    )


def batch_pool(names: list[str], rank: int) -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    """``POOL`` batches of ``BATCH`` samples with 1-8 ids per feature, different on each rank."""
    generator = torch.Generator().manual_seed(1000 + rank)
    pool = []
    for _ in range(POOL):
        lengths = torch.randint(1, 9, (len(names) * BATCH,), generator=generator)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=generator)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{n}" for n in names], values=values, lengths=lengths)
        pool.append((kjt, torch.randn(BATCH, generator=generator)))
    return pool


def rss_mib() -> float:
    """This process's resident set size (VmRSS) in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def quiet_logs() -> None:
    """Hide third-party log warnings: TorchRec's planner (direct Topology, dry-run estimates,
    no sharding spec for data-parallel tables, on the root logger) and torch.fx's tracing notice."""
    logging.getLogger().setLevel(logging.ERROR)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


def save_checkpoint(root: Path, dmp: nn.Module, opt, sched, step: int, rank: int) -> None:
    """Save step ``step`` (a collective) and, on rank 0, drop all but the last ``KEEP_CHECKPOINTS``."""
    checkpoint.save(root, dmp, opt, {"scheduler": sched, "step": step})
    if rank == 0:  # save ends with a barrier: every rank is done with the old directories
        for old in sorted(root.glob("step-*"))[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old)


def train(rank: int, world_size: int, steps: int, checkpoint_every: int, root: str) -> dict:
    """One rank's soak run: ``{"samples": [(step, RSS MiB)], "seconds": training time, "checkpoint_seconds": ...}``."""
    from tqdm import tqdm

    torch.set_num_threads(1)
    quiet_logs()
    dmp = build(world_size)
    opt = overlap_optim.get_optimizers(dmp)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step / 5000))
    pool = batch_pool(list(_table_settings()), rank)
    samples = [(0, rss_mib())]
    checkpoint_seconds = 0.0
    dist.barrier()
    start = time.perf_counter()
    for step in tqdm(range(1, steps + 1), disable=rank != 0, desc="soak", unit="step", mininterval=2.0):
        kjt, target = pool[step % POOL]
        (dmp(kjt) - target).pow(2).mean().backward()
        opt.step()
        sched.step()
        if step % checkpoint_every == 0:
            begin = time.perf_counter()
            save_checkpoint(Path(root), dmp, opt, sched, step, rank)
            checkpoint_seconds += time.perf_counter() - begin
        if step % SAMPLE_EVERY == 0:
            samples.append((step, rss_mib()))
    dist.barrier()
    return {"samples": samples, "seconds": time.perf_counter() - start, "checkpoint_seconds": checkpoint_seconds}


def summarize(results: list[dict], steps: int, warmup: int) -> bool:
    """Print each rank's RSS at the end of warm-up, at the end, its max and growth; True when all pass."""
    passed = True
    print(f"{'rank':>4} {'RSS@' + str(warmup) + ' MiB':>14} {'final MiB':>10} {'max MiB':>9} {'growth':>8} "
          f"{'time s':>8} {'ckpt s':>7} {'steps/s':>8}")
    for rank, result in enumerate(results):
        rss = dict(result["samples"])
        base, final = rss[warmup], rss[max(rss)]
        peak = max(v for s, v in rss.items() if s >= warmup)
        growth = (final - base) / base
        passed &= growth < MAX_GROWTH
        print(f"{rank:>4} {base:>14.1f} {final:>10.1f} {peak:>9.1f} {growth:>+8.2%} {result['seconds']:>8.1f} "
              f"{result['checkpoint_seconds']:>7.1f} {steps / result['seconds']:>8.1f}")
    print(f"criterion: final RSS < {MAX_GROWTH:.0%} above RSS at step {warmup} on every rank: "
          f"{'PASSED' if passed else 'FAILED'}")
    return passed


def plot(results: list[dict], warmup: int, out: Path) -> None:
    """RSS against step, one line per rank, warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for rank, result in enumerate(results):
        steps, rss = zip(*result["samples"])
        ax.plot(steps, rss, marker=".", label=f"rank {rank}")
    ax.axvspan(0, warmup, color="grey", alpha=0.15, label="warm-up")
    ax.set_xlabel("step")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("Soak: resident memory per rank (2 ranks, gloo)")
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--checkpoint-every", type=int, default=1_000)
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_OUT))
    args = parser.parse_args(argv)
    if args.checkpoint_every % SAMPLE_EVERY or args.steps < args.checkpoint_every:
        parser.error(f"--checkpoint-every must be a multiple of {SAMPLE_EVERY} and at most --steps")
    with tempfile.TemporaryDirectory(prefix="soak-ckpt-") as root:
        results = run_ranks(train, args.steps, args.checkpoint_every, root, world_size=WORLD_SIZE,
                            timeout=max(600.0, args.steps * 0.5))
    passed = summarize(results, args.steps, args.checkpoint_every)
    plot(results, args.checkpoint_every, args.out)
    print(f"plot: {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
