"""Virtual parameter groups: many learning rates at the cost of one, dense (DDP hook) and sparse (fallback kernel).

Settings that differ only in floats (per-layer or per-table learning rates) share one
multi-tensor update, each tensor with its own scalars (:mod:`overlap_optim.virtual_groups`).
All peers run in one process on a world of one (gloo), alternating.

Dense: an MLP of 48 ``Linear`` layers (widths alternating 64/128, batch 16, so the
update is a large share of the step) with Adam, through DDP:

- ``ours, k lrs``: one ``apply_optimizer_in_backward`` call per group of layers (k = 1,
  24, 48 distinct learning rates), then ``register_optimizer_hook``;
- ``ddp_foreach, k lrs``: plain DDP, then ``torch.optim.Adam(foreach=True)`` with k
  param groups, stepped after backward;
- ``ddp_no_update``: forward and backward only, what every peer pays anyway.

Sparse: 6 fallback tables (Adam, one annotation and learning rate each), sharded
table_wise by our sharder under ``DistributedModelParallel``:

- ``new``: today's grouping, the 6 tables form one virtual group and share one kernel
  (one lookup, one multi-tensor update with 6 learning rates);
- ``old``: the grouping before virtual groups, one kernel per annotation, emulated by
  patching ``sharders.fallback.FallbackTable.batch_key`` while the model is sharded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from benchmarks._sharded import batch, ensure_world_of_one
from benchmarks._timing import time_peers
from overlap_optim import apply_optimizer_in_backward, register_optimizer_hook

WIDTHS = (64, 128)
DIM = 64
TABLES = 6


def _lrs(count: int) -> list[float]:
    """``count`` distinct learning rates."""
    return [1e-3 * 0.95**i for i in range(count)]


# -- dense: an MLP through DDP ------------------------------------------------------------------------


def _mlp(layers: int) -> nn.Sequential:
    """He-initialised, so activations and gradients keep their scale through the layers: with
    the default init they shrink layer by layer and ~10% of the squared gradients of 48 layers are
    denormal floats, on which ``sqrt`` is ~10x slower (it was the top operator of every peer)."""
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        linear = nn.Linear(WIDTHS[i % 2], WIDTHS[(i + 1) % 2])
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        mods += [linear, nn.ReLU()]
    return nn.Sequential(*mods)


def _lr_groups(model: nn.Sequential, count: int) -> list[list[torch.Tensor]]:
    """The layers' parameters in ``count`` groups of consecutive layers."""
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert len(linears) % count == 0, (len(linears), count)
    per = len(linears) // count
    return [[p for m in linears[i * per : (i + 1) * per] for p in m.parameters()] for i in range(count)]


def _ours(layers: int, count: int) -> DDP:
    model = _mlp(layers)
    for params, lr in zip(_lr_groups(model, count), _lrs(count)):
        apply_optimizer_in_backward(torch.optim.Adam, params, {"lr": lr})
    ddp = DDP(model)
    register_optimizer_hook(ddp)
    return ddp


def _ddp_foreach(layers: int, count: int) -> tuple[DDP, torch.optim.Optimizer]:
    model = _mlp(layers)
    groups = [{"params": p, "lr": lr} for p, lr in zip(_lr_groups(model, count), _lrs(count))]
    return DDP(model), torch.optim.Adam(groups, foreach=True)


def _dense_steps(layers: int, counts: tuple[int, ...], batch_size: int) -> dict[str, Callable[[], None]]:
    x = torch.randn(batch_size, WIDTHS[0], generator=torch.Generator().manual_seed(0))

    def in_backward(ddp: DDP) -> Callable[[], None]:
        return lambda: ddp(x).square().mean().backward()

    def after_backward(count: int) -> Callable[[], None]:
        ddp, optimizer = _ddp_foreach(layers, count)

        def step() -> None:
            ddp(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    steps = {"ddp_no_update": in_backward(DDP(_mlp(layers)))}
    for count in counts:
        steps[f"ours, {count} lrs"] = in_backward(_ours(layers, count))
    for count in (counts[0], counts[-1]):
        steps[f"ddp_foreach, {count} lrs"] = after_backward(count)
    return steps


def _dense_agreement(layers: int, count: int, batch_size: int, steps: int = 3) -> float:
    """Max |difference| of the weights of ours and of torch's Adam after a few steps (same lrs)."""
    x = torch.randn(batch_size, WIDTHS[0], generator=torch.Generator().manual_seed(1))
    ours = _ours(layers, count)
    plain, optimizer = _ddp_foreach(layers, count)
    for _ in range(steps):
        ours(x).square().mean().backward()
        plain(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return max((a - b).abs().max().item() for a, b in zip(ours.parameters(), plain.parameters()))


def _dense(quick: bool) -> dict:
    layers, counts, batch_size = (4, (1, 2, 4), 8) if quick else (48, (1, 24, 48), 16)
    warmup, repeats = (1, 3) if quick else (10, 60)
    ensure_world_of_one()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: one thread, and less exposed to the other jobs on this machine
    try:
        timings = time_peers(_dense_steps(layers, counts, batch_size), warmup, repeats)
        agreement = _dense_agreement(layers, counts[-1], batch_size)
    finally:
        torch.set_num_threads(threads)
    median = {peer: t["median_s"] for peer, t in timings.items()}
    one, many = counts[0], counts[-1]
    ours_many = median[f"ours, {many} lrs"]
    base = median["ddp_no_update"]
    ratios = {
        f"dense, ours: step at {many} lrs / at {one} (target <= 1.1)": ours_many / median[f"ours, {one} lrs"],
        f"dense, ours: step at {counts[1]} lrs / at {one}": (
            median[f"ours, {counts[1]} lrs"] / median[f"ours, {one} lrs"]),
        f"dense, {many} lrs: ddp_foreach / ours (target >= 2)": median[f"ddp_foreach, {many} lrs"] / ours_many,
        f"dense, {many} lrs, update cost (step - ddp_no_update): ddp_foreach / ours": (
            median[f"ddp_foreach, {many} lrs"] - base) / max(ours_many - base, 1e-9),
        f"dense, torch's ddp_foreach: step at {many} lrs / at {one}": (
            median[f"ddp_foreach, {many} lrs"] / median[f"ddp_foreach, {one} lrs"]),
    }
    setup = {"layers": layers, "parameter_tensors": 2 * layers, "widths": list(WIDTHS), "batch": batch_size,
             "learning_rate_counts": list(counts), "repeats": repeats, "threads": 1,
             f"max_abs_weight_diff_ours_vs_torch_adam_{many}_lrs_3_steps": agreement}
    return {"setup": setup, "timings": {f"dense: {p}": t for p, t in timings.items()}, "ratios": ratios}


# -- sparse: 6 fallback tables through our sharder --------------------------------------------------------


class Tables(nn.Module):
    """``TABLES`` tables ``t0..`` (features ``f0..``) and a linear head; built on meta, materialised by DMP."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f{i}"])
                   for i in range(TABLES)]
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        self.head = nn.Linear(TABLES * DIM, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.ebc(kjt).values()).sum()


@contextlib.contextmanager
def old_grouping() -> Iterator[None]:
    """While sharding, fallback tables share a kernel only within one annotation, as before
    virtual groups (``FallbackTable.batch_key`` keyed by the annotation group)."""
    from sharders.fallback import FallbackTable

    new = FallbackTable.batch_key
    FallbackTable.batch_key = lambda table: ("group", id(table.group))
    try:
        yield
    finally:
        FallbackTable.batch_key = new


def _sharded_tables(rows: int, old: bool) -> nn.Module:
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    import sharders

    ensure_world_of_one()
    torch.manual_seed(0)  # the same head in both models; the tables are copied over (see _sparse)
    model = Tables(rows)
    for i, lr in enumerate(_lrs(TABLES)):
        apply_optimizer_in_backward(torch.optim.Adam, model.ebc.embedding_bags[f"t{i}"].parameters(), {"lr": lr})
    sharder = sharders.EmbeddingBagCollectionSharder()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"),
        constraints={f"t{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(TABLES)},
    )
    with old_grouping() if old else contextlib.nullcontext():
        plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
        return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def _kjts(rows: int, bags: int, pooling: int, count: int) -> list[KeyedJaggedTensor]:
    """``count`` batches, each of ``bags`` bags of ``pooling`` uniform ids for every table."""
    kjts = []
    for seed in range(count):
        parts = [batch(rows, bags, pooling, seed * TABLES + i) for i in range(TABLES)]
        values = torch.cat([ids for ids, _ in parts])
        lengths = torch.full((TABLES * bags,), pooling, dtype=torch.long)
        kjts.append(KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(TABLES)], values=values,
                                                        lengths=lengths))
    return kjts


def _stepper(model: nn.Module, kjts: list[KeyedJaggedTensor]) -> Callable[[], None]:
    state = {"i": 0}

    def step() -> None:
        kjt = kjts[state["i"] % len(kjts)]
        state["i"] += 1
        model(kjt).backward()

    return step


def _table_weights(model: nn.Module) -> list[torch.Tensor]:
    """Each table's local shard (the whole table, on a world of one): views of the kernel's weights."""
    state = model.state_dict()
    return [state[f"ebc.embedding_bags.t{i}.weight"].local_shards()[0].tensor for i in range(TABLES)]


def _sparse(quick: bool) -> dict:
    from sharders.describe import kernel_rows

    rows = 2_000 if quick else 100_000
    batches = (64,) if quick else (128, 2048)
    pooling = 5
    warmup, repeats = (1, 3) if quick else (5, 100)
    models = {"new": _sharded_tables(rows, old=False), "old": _sharded_tables(rows, old=True)}
    with torch.no_grad():
        for new, old in zip(_table_weights(models["new"]), _table_weights(models["old"])):
            old.copy_(new)
    kernels = {name: len(kernel_rows(model)) for name, model in models.items()}
    timings, ratios = {}, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the peers differ in grouping, not in parallelism; one thread is the least noisy here
    try:
        timed_by_batch = {}
        for bags in batches:
            kjts = _kjts(rows, bags, pooling, 4)
            timed_by_batch[bags] = time_peers({name: _stepper(model, kjts) for name, model in models.items()},
                                              warmup, repeats)
    finally:
        torch.set_num_threads(threads)
    for bags, timed in timed_by_batch.items():
        timings.update({f"sparse: {name} ({kernels[name]} kernel{'s' * (kernels[name] > 1)}), batch {bags}": t
                        for name, t in timed.items()})
        ratios[f"sparse, batch {bags}: step, old {kernels['old']} kernels / new {kernels['new']} (target >= 1)"] = (
            timed["old"]["median_s"] / timed["new"]["median_s"])
    # Both models saw the same batches in the same order: the grouping must not change the result.
    pairs = zip(_table_weights(models["new"]), _table_weights(models["old"]))
    agreement = max((a - b).abs().max().item() for a, b in pairs)
    ratios["sparse: kernels, old / new"] = kernels["old"] / kernels["new"]
    setup = {"tables": TABLES, "rows": rows, "dim": DIM, "bags_per_table": list(batches), "pooling": pooling,
             "optimizer": "Adam, one learning rate per table", "sharding": "table_wise, world of one",
             "kernels": kernels, "repeats": repeats, "threads": 1, "max_abs_weight_diff_old_vs_new": agreement}
    return {"setup": setup, "timings": timings, "ratios": ratios}


def run(quick: bool) -> dict:
    """Measure; returns a JSON-able result with ratios."""
    dense, sparse = _dense(quick), _sparse(quick)
    return {
        "setup": {"dense": dense["setup"], "sparse": sparse["setup"]},
        "timings": {**dense["timings"], **sparse["timings"]},
        "ratios": {**dense["ratios"], **sparse["ratios"]},
    }
