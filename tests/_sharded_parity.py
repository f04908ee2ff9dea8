"""Rank bodies for the sharder parity tests (spawned; not collected by pytest)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

import sharders
from _models import ManyTableModel, concat_batches, covering_batch, loss_of
from overlap_optim import apply_optimizer_in_backward

COLUMN_SPLITTING = ("column_wise", "table_column_wise")


def build(names, settings, sharding_type, world_size, sharder=None):
    """(sharded DMP model, unsharded reference, reference optimizers) from one seed."""
    model = ManyTableModel(names)
    reference = copy.deepcopy(model)
    for name, (cls, kwargs) in zip(names, settings):
        apply_optimizer_in_backward(cls, model.ebc.embedding_bags[name].parameters(), kwargs)
    ref_opts = [cls(reference.ebc.embedding_bags[n].parameters(), **kw) for n, (cls, kw) in zip(names, settings)]
    sharder = sharder or sharders.EmbeddingBagCollectionSharder()
    constraints = {
        n: ParameterConstraints(sharding_types=[sharding_type], min_partition=4) for n in names
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    with torch.no_grad():  # sharding re-initialises tables: start both from the reference's weights
        for name in names:
            ref = reference.ebc.embedding_bags[name].weight
            for row, col, piece in local_pieces(dmp, name):
                piece.copy_(ref[row : row + piece.shape[0], col : col + piece.shape[1]])
    return dmp, reference, ref_opts


def local_pieces(dmp, name):
    """[(row offset, col offset, local tensor)] of table ``name`` held by this rank."""
    value = dmp.state_dict()[f"ebc.embedding_bags.{name}.weight"]
    if isinstance(value, ShardedTensor):
        return [(s.metadata.shard_offsets[0], s.metadata.shard_offsets[1], s.tensor) for s in value.local_shards()]
    return [(0, 0, value)]


def compare(dmp, reference, names, step, atol=1e-5):
    for name in names:
        ref = reference.ebc.embedding_bags[name].weight.detach()
        for row, col, piece in local_pieces(dmp, name):
            want = ref[row : row + piece.shape[0], col : col + piece.shape[1]]
            diff = (piece - want).abs().max().item() if piece.numel() else 0.0
            assert diff <= atol, f"step {step}, table {name}: max diff {diff:.3g} from torch.optim"


def train_and_compare(rank, world_size, names, settings, sharding_type, steps=3, cover=True):
    """Train sharded and reference side by side; compare after every step. Returns how far
    the reference moved, per table."""
    dmp, reference, ref_opts = build(names, settings, sharding_type, world_size)
    start = {n: reference.ebc.embedding_bags[n].weight.detach().clone() for n in names}
    compare(dmp, reference, names, "before training", atol=0.0)
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 + step)
        parts = [covering_batch(names, generator, cover=cover) for _ in range(world_size)]
        loss_of(dmp, parts[rank]).backward()
        loss_of(reference, concat_batches(parts)).backward()
        for opt in ref_opts:
            opt.step()
        reference.zero_grad()
        compare(dmp, reference, names, step)
    return {n: (reference.ebc.embedding_bags[n].weight.detach() - start[n]).abs().max().item() for n in names}


SHARDING_TYPES = ("data_parallel", "table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise")


def matrix(rank, world_size, cases, sharding_types=SHARDING_TYPES):
    """Every case as its own table of one EBC, for each sharding type."""
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    moved = {}
    for sharding_type in sharding_types:
        kept = [c for c in cases if not (sharding_type in COLUMN_SPLITTING and c[1] is RowWiseAdagrad)]
        names = [c[0] for c in kept]
        moved[sharding_type] = train_and_compare(rank, world_size, names, [(c[1], c[2]) for c in kept], sharding_type)
    return moved
