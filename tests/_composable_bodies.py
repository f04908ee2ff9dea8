"""Rank bodies for issue 8: unannotated tables, and shard + plain DDP (spawned; not collected by pytest)."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import overlap_optim
import sharders
from _models import ManyTableModel, concat_batches, covering_batch, loss_of
from _sharded_parity import build, compare, local_pieces
from overlap_optim import apply_optimizer_in_backward, checkpoint, get_optimizers, unoptimized_parameters

NAMES = ["adam", "sgd", "bare"]
SETTINGS = [(torch.optim.Adam, {"lr": 0.02}), (torch.optim.SGD, {"lr": 0.1})]
USER_LR = 0.01


def _annotate_some(model, names=NAMES, settings=SETTINGS):
    for name, (cls, kwargs) in zip(names, settings):
        apply_optimizer_in_backward(cls, model.ebc.embedding_bags[name].parameters(), kwargs)


def train_with_bare(rank, world_size, sharding_type, steps=3):
    """On ``sharding_type``: the bare table's gradient comes back and the user's Adam trains it
    (with the MLP); the annotated tables keep their kernels; compared after every step."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    model = ManyTableModel(NAMES)
    reference = copy.deepcopy(model)
    _annotate_some(model)
    ref_opts = [cls(reference.ebc.embedding_bags[n].parameters(), **kw) for n, (cls, kw) in zip(NAMES, SETTINGS)]
    ref_opts.append(torch.optim.Adam([*reference.ebc.embedding_bags["bare"].parameters(),
                                      *reference.dense.parameters()], lr=USER_LR))
    sharder = sharders.EmbeddingBagCollectionSharder()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints={n: ParameterConstraints(sharding_types=[sharding_type], min_partition=4) for n in NAMES},
    )
    dmp = DistributedModelParallel(model, device=torch.device("cpu"),
                                   plan=planner.collective_plan(model, [sharder], dist.group.WORLD), sharders=[sharder])
    with torch.no_grad():
        for name in NAMES:
            ref = reference.ebc.embedding_bags[name].weight
            for row, col, piece in local_pieces(dmp, name):
                piece.copy_(ref[row : row + piece.shape[0], col : col + piece.shape[1]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keyed = get_optimizers(dmp)
        get_optimizers(dmp)  # a second call does not warn again
    mine = unoptimized_parameters(dmp)
    user = torch.optim.Adam(mine.values(), lr=USER_LR)
    start = reference.ebc.embedding_bags["bare"].weight.detach().clone()
    grads_back = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(200 + step)
        parts = [covering_batch(NAMES, generator) for _ in range(world_size)]
        loss_of(dmp, parts[rank]).backward()
        bare = mine.get("ebc.embedding_bags.bare.weight")
        grads_back.append(None if bare is None else bare.grad is not None)
        user.step()
        user.zero_grad()
        keyed.step()
        loss_of(reference, concat_batches(parts)).backward()
        for opt in ref_opts:
            opt.step()
        reference.zero_grad()
        compare(dmp, reference, NAMES, step)
    return {
        "warnings": [str(w.message) for w in caught if "unoptimized_parameters" in str(w.message)],
        "unoptimized": sorted(mine),
        "optimized": sorted(keyed.params),
        "grads_back": grads_back,
        "describe": sharders.describe(dmp),
        "moved": (reference.ebc.embedding_bags["bare"].weight.detach() - start).abs().max().item(),
    }


# -- the composable path --

COMPOSABLE = ["t0", "t1"]
PLAN = {"t0": "table_wise", "t1": "row_wise"}


def _composable_model(seed=0):
    """The design sketch: per-table and MLP annotations, tables sharded alone, the MLP in plain DDP."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.shard import shard
    from torchrec.distributed.types import ShardingEnv

    model = ManyTableModel(COMPOSABLE, seed=seed)
    reference = copy.deepcopy(model)
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.embedding_bags["t0"].parameters(), {"lr": 0.02})
    apply_optimizer_in_backward(torch.optim.Adam, model.ebc.embedding_bags["t1"].parameters(), {"lr": 0.04})
    apply_optimizer_in_backward(torch.optim.Adagrad, model.dense.parameters(), {"lr": 0.006})
    sharder = sharders.EmbeddingBagCollectionSharder()
    world_size = dist.get_world_size()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints={n: ParameterConstraints(sharding_types=[t], min_partition=4) for n, t in PLAN.items()},
    )
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    model.ebc = shard(model.ebc, plan.get_plan_for_module("ebc"), ShardingEnv.from_process_group(dist.group.WORLD),
                      torch.device("cpu"), sharder)
    model.dense = DistributedDataParallel(model.dense)
    overlap_optim.register_optimizer_hook(model.dense)
    ref_opts = [torch.optim.SGD(reference.ebc.embedding_bags["t0"].parameters(), lr=0.02),
                torch.optim.Adam(reference.ebc.embedding_bags["t1"].parameters(), lr=0.04),
                torch.optim.Adagrad(reference.dense.parameters(), lr=0.006)]
    with torch.no_grad():  # start the shards from the reference's weights
        for name in COMPOSABLE:
            value = model.ebc.state_dict()[f"embedding_bags.{name}.weight"]
            for shard_ in value.local_shards():
                (row, col), (rows, cols) = shard_.metadata.shard_offsets, shard_.metadata.shard_sizes
                shard_.tensor.copy_(reference.ebc.embedding_bags[name].weight[row : row + rows, col : col + cols])
    return model, reference, ref_opts


def _compare_composable(model, reference, step, atol=1e-5):
    for name, param in reference.dense.named_parameters():
        diff = (model.dense.module.get_parameter(name) - param).abs().max().item()
        assert diff <= atol, f"step {step}, dense.{name}: {diff:.3g} from torch.optim"
    for name in COMPOSABLE:
        value = model.ebc.state_dict()[f"embedding_bags.{name}.weight"]
        for shard_ in value.local_shards():
            (row, col), (rows, cols) = shard_.metadata.shard_offsets, shard_.metadata.shard_sizes
            want = reference.ebc.embedding_bags[name].weight[row : row + rows, col : col + cols]
            diff = (shard_.tensor - want).abs().max().item()
            assert diff <= atol, f"step {step}, table {name}: {diff:.3g} from torch.optim"


def _layout(keyed):
    state = keyed.state_dict()
    return ({(k, n): tuple(v.size()) for k, s in state["state"].items() for n, v in s.items()},
            [g["params"] for g in state["param_groups"]])


def composable(rank, world_size, directory):
    """Parity with the unsharded reference; state_dict round trip; the same keys as DMP; a
    checkpoint moves from the composable model into DMP; DDP without our hook is refused."""
    model, reference, ref_opts = _composable_model()
    keyed = get_optimizers(model)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    for step in range(4):
        generator = torch.Generator().manual_seed(300 + step)
        parts = [covering_batch(COMPOSABLE, generator) for _ in range(world_size)]
        loss_of(model, parts[rank]).backward()
        keyed.step()
        loss_of(reference, concat_batches(parts)).backward()
        for opt in ref_opts:
            opt.step()
        reference.zero_grad()
        _compare_composable(model, reference, step)
    moved = min((p.detach() - start[n]).abs().max().item() for n, p in reference.named_parameters())

    saved = keyed.state_dict()
    fresh, _, _ = _composable_model(seed=1)
    fresh_opt = get_optimizers(fresh)
    fresh_opt.init_state()
    fresh_opt.load_state_dict(saved)
    round_trip = _same_state(saved, fresh_opt.state_dict())

    dmp, _, _ = build(COMPOSABLE, [(torch.optim.SGD, {"lr": 0.02}), (torch.optim.Adam, {"lr": 0.04})], PLAN,
                      world_size, dense=(torch.optim.Adagrad, {"lr": 0.006}), seed=2, dense_layers=(0, 2))
    dmp_opt = get_optimizers(dmp)
    checkpoint.save(directory, model, keyed, {"step": 4})
    checkpoint.load(directory, dmp, dmp_opt)
    dense_in_dmp = max((dmp.state_dict()[f"dense.{n}"] - p).abs().max().item() for n, p in reference.dense.named_parameters())
    return {"moved": moved, "round_trip": round_trip, "layout": _layout(keyed), "dmp_layout": _layout(dmp_opt),
            "dense_in_dmp_after_load": dense_in_dmp, "refusal": _ddp_without_hook(rank)}


def _same_state(a, b):
    def local(v):
        return [s.tensor for s in v.local_shards()] if hasattr(v, "local_shards") else [v]

    if a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(x, y) for k, s in a["state"].items() for n, v in s.items()
               for x, y in zip(local(v), local(b["state"][k][n])))


def _ddp_without_hook(rank):
    model = ManyTableModel(COMPOSABLE)
    apply_optimizer_in_backward(torch.optim.SGD, model.dense.parameters(), {"lr": 0.1})
    ddp = DistributedDataParallel(model.dense)
    try:
        ddp(torch.randn(4, model.dense[0].in_features)).sum().backward()
    except RuntimeError as err:
        return str(err)
    return "no error"
