"""Rank bodies for tests/test_torchrec_patterns.py (spawned; not collected by pytest).

TorchRec users' own patterns, each checked against plain torch.optim on the unsharded model
after every step: TorchRec's CombinedOptimizer over DMP's fused_optimizer and a user optimizer
for the rest (``in_backward_optimizer_filter``); a model built wholly on the meta device; and
tables given dense semantics on request, on batches that touch only some rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import overlap_optim
import sharders
from _models import ROWS, concat_batches, covering_batch, loss_of
from _sharded_parity import FAMILIES, SHARDING_TYPES, build, compare, local_pieces, step_side_by_side

# Table -> its optimizer, None for a table left to the user's optimizer.
TABLES = {
    "fused": (torch.optim.Adagrad, {"lr": 0.2}),
    "fallback": (torch.optim.Adam, {"lr": 0.05}),
    "replicated": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),  # always data_parallel
    "plain": None,
}
DENSE = (torch.optim.Adam, {"lr": 0.01})  # on dense[0]; dense[2] is the user's
USER_LR = 0.1


def _plan(model, sharder, types, world_size):
    constraints = {n: ParameterConstraints(sharding_types=[t], min_partition=4) for n, t in types.items()}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints=constraints,
    )
    return planner.collective_plan(model, [sharder], dist.group.WORLD)


def _annotate(model, tables, dense):
    for name, setting in tables.items():
        if setting is not None:
            overlap_optim.apply_optimizer_in_backward(setting[0], model.tables[name].parameters(), setting[1])
    if dense is not None:
        overlap_optim.apply_optimizer_in_backward(dense[0], model.dense[0].parameters(), dense[1])


def _reference_optimizers(reference, tables, dense):
    opts = [cls(reference.tables[n].parameters(), **kw) for n, (cls, kw) in
            ((n, s) for n, s in tables.items() if s is not None)]
    if dense is not None:
        opts.append(dense[0](reference.dense[0].parameters(), **dense[1]))
    user = [p for n, s in tables.items() if s is None for p in reference.tables[n].parameters()]
    return opts + [torch.optim.SGD(user + list(reference.dense[2].parameters()), lr=USER_LR)]


def _copy_reference_weights(dmp, reference, names):
    """Sharding (and DMP's init_parameters) re-initialise: start from the reference's values."""
    with torch.no_grad():
        for name in names:
            ref = reference.tables[name].weight
            for row, col, piece in local_pieces(dmp, name):
                piece.copy_(ref[row : row + piece.shape[0], col : col + piece.shape[1]])
        for ours, ref in zip((p for n, p in dmp.named_parameters() if n.startswith("dense.")),
                             reference.dense.parameters()):
            ours.copy_(ref)


def _train(dmp, reference, ref_opts, user, names, rank, world_size, steps=3, cover=True):
    """Train both side by side, comparing after every step; how far the reference moved."""
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    compare(dmp, reference, names, "before training", atol=0.0)
    for step in range(steps):
        generator = torch.Generator().manual_seed(300 + step)
        parts = [covering_batch(names, generator, cover=cover) for _ in range(world_size)]
        step_side_by_side(dmp, reference, ref_opts, names, parts, rank, step, user=user)
    return {n: (p.detach() - start[n]).abs().max().item() for n, p in reference.named_parameters()}


def combined_optimizer_run(rank, world_size, sharding_type, device="cpu", family="ebc"):
    """Build, shard (DMP + our wrapper) and train with TorchRec's CombinedOptimizer pattern:
    (the keys the user's optimizer got, how far each reference parameter moved).
    ``family``: "ebc" or "ec" (``_sharded_parity.FAMILIES``)."""
    names = list(TABLES)
    model_class, sharder_class = FAMILIES[family]
    reference = model_class(names, seed=1)
    model = model_class(names, seed=1, device=device)
    if device == "cpu":
        model.load_state_dict(reference.state_dict())
    _annotate(model, TABLES, DENSE)
    sharder = sharder_class()
    types = {n: "data_parallel" if n == "replicated" else sharding_type for n in names}
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=_plan(model, sharder, types, world_size),
                                   sharders=[sharder], data_parallel_wrapper=sharders.DataParallelWrapper())
    _copy_reference_weights(dmp, reference, names)
    user_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    user = KeyedOptimizerWrapper(user_params, lambda ps: torch.optim.SGD(ps, lr=USER_LR))
    combined = CombinedOptimizer([dmp.fused_optimizer, user])
    moved = _train(dmp, reference, _reference_optimizers(reference, TABLES, DENSE), combined, names, rank, world_size)
    return {"user_keys": sorted(user_params), "moved": moved}


DENSE_TABLES = {  # both fusable or lazy by default; named in dense_tables
    "adam": (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.05}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.2}),
    "momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def dense_tables(rank, world_size, sharding_type):
    """Tables named in ``dense_tables`` on batches that touch only some rows, compared every step
    with torch.optim on the dense unsharded tables: (how far each moved, describe()'s rows)."""
    names = list(DENSE_TABLES)
    sharder = sharders.EmbeddingBagCollectionSharder(dense_tables=names)
    dmp, reference, ref_opts = build(names, list(DENSE_TABLES.values()), sharding_type, world_size, sharder=sharder)
    start = {n: reference.tables[n].weight.detach().clone() for n in names}
    untouched = []
    for step in range(4):
        generator = torch.Generator().manual_seed(500 + step)
        parts = [covering_batch(names, generator, cover=False) for _ in range(world_size)]
        loss_of(dmp, parts[rank]).backward()
        batch = concat_batches(parts)
        untouched.append(ROWS - batch[0]["f_adam"].values().unique().numel())
        loss_of(reference, batch).backward()
        for opt in ref_opts:
            opt.step()
        reference.zero_grad()
        compare(dmp, reference, names, step)
    moved = {n: (reference.tables[n].weight.detach() - start[n]).abs().max().item() for n in names}
    rows = [(d.table, d.kernel, d.semantics) for d in sharders.plan_of(dmp.module.ebc).tables.values()]
    return {"moved": moved, "untouched": untouched, "decisions": rows}
