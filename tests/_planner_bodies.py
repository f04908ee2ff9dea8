"""Rank bodies for tests/test_planner.py (spawned; not collected by pytest)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import overlap_optim
import sharders
from _memory import allocated_peak
from sharders.planner import EmbeddingShardingPlanner

ROWS = 4000
# The model: four 4000 x 64 tables whose real state TorchRec's multiplier gets wrong.
FOUR = [("amsgrad", torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
        ("momentum", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        ("adamw", torch.optim.AdamW, {"lr": 0.01}),
        ("adafactor", torch.optim.Adafactor, {"lr": 0.01})]
WIDE = [("rowwise", RowWiseAdagrad, {"lr": 0.1})]  # 4000 x 256: must be split under a small cap
WIDE_DECAYED = [("rowwise", RowWiseAdagrad, {"lr": 0.1, "weight_decay": 0.01})]  # no column-shard form
MODELS = {"four": (FOUR, 64), "wide": (WIDE, 256), "adafactor": (FOUR[3:], 64),
          "wide_decayed": (WIDE_DECAYED, 256)}  # (tables, dim)


def _model(specs, dim):
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=ROWS, feature_names=[f"f_{n}"]) for n, _, _ in specs])
    for name, cls, kwargs in specs:
        overlap_optim.apply_optimizer_in_backward(cls, [ebc.embedding_bags[name].weight], kwargs)
    return torch.nn.Sequential(ebc)


def held_bytes(dmp) -> int:
    """This rank's bytes of table weights and optimizer state (local shards; scalars aside)."""
    def size(value):
        if isinstance(value, ShardedTensor):
            return sum(s.tensor.numel() * s.tensor.element_size() for s in value.local_shards())
        return value.numel() * value.element_size() if torch.is_tensor(value) and value.dim() else 0

    total = sum(size(v) for k, v in dmp.state_dict().items() if "embedding_bags" in k)
    for state in overlap_optim.get_optimizers(dmp).state_dict()["state"].values():
        total += sum(size(v) for v in state.values())
    return total


def capped(rank, world_size, which, cap, constraints=None):
    """Plan ``which`` (of :data:`MODELS`) with a DDR cap of ``cap`` table weights per rank and no
    storage reservation; shard, take one step. Returns the plan, this rank's bytes after the step,
    and the most a second step (forward and backward) allocated above what the rank held (in table
    weights); or the planner's error as "Type: message"."""
    specs, dim = MODELS[which]
    weight = ROWS * dim * 4
    model = _model(specs, dim)
    sharder = sharders.EmbeddingBagCollectionSharder()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size,
                          ddr_cap=int(cap * weight)),
        storage_reservation=FixedPercentageStorageReservation(0.0),
        constraints={n: ParameterConstraints(sharding_types=t) for n, t in (constraints or {}).items()},
    )
    try:
        plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return {"error": f"{type(err).__name__}: {err}"}
    types = {n: p.sharding_type for n, p in plan.plan["0"].items()}
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    generator = torch.Generator().manual_seed(rank)
    names = [s[0] for s in specs]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{n}" for n in names], values=torch.randint(0, ROWS, (len(names) * 64 * 5,), generator=generator),
        lengths=torch.full((len(names) * 64,), 5))
    sum(v.sum() for v in dmp(kjt).to_dict().values()).backward()  # the state is made
    held = held_bytes(dmp)
    peak = allocated_peak(lambda: sum(v.sum() for v in dmp(kjt).to_dict().values()).backward())
    return {"types": types, "held": held / weight, "peak": peak / weight}


class _WithDense(torch.nn.Module):
    """The issue's four tables and a dense part: a 256 x 256 layer under AdamW, a 256 x 1 one under
    SGD with momentum (about 1 W under DDP with their state)."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = _model(FOUR, 64)[0]
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4 * 64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
        overlap_optim.apply_optimizer_in_backward(torch.optim.AdamW, self.mlp[0].parameters(), {"lr": 0.01})
        overlap_optim.apply_optimizer_in_backward(torch.optim.SGD, self.mlp[2].parameters(), {"lr": 0.1, "momentum": 0.9})

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.mlp(self.ebc(kjt).values()).sum()


def with_dense(rank, world_size, cap):
    """The four tables and a dense part planned under a DDR cap of ``cap`` table weights per rank by our
    planner with its default reservation (the dense part's bytes), sharded with our data-parallel
    wrapper; one step. Returns, in table weights: what the reservation took for the dense part, what
    the dense part holds after the step (its parameters, DDP's gradient buckets as DDP reports them,
    and the optimizer state of its parameters) and all this rank holds (tables too); or the error."""
    weight = ROWS * 64 * 4
    model = _WithDense()
    sharder = sharders.EmbeddingBagCollectionSharder()
    planner = EmbeddingShardingPlanner(topology=Topology(
        world_size=world_size, compute_device="cpu", local_world_size=world_size, ddr_cap=int(cap * weight)))
    try:
        plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return {"error": f"{type(err).__name__}: {err}"}
    reserved = sharders.dense_bytes(model, [sharder])
    if rank == 0:  # the rank that planned: the reservation took exactly that
        assert planner._storage_reservation._dense_storage.ddr == reserved
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                   data_parallel_wrapper=sharders.DataParallelWrapper())
    generator = torch.Generator().manual_seed(rank)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{n}" for n, _, _ in FOUR], values=torch.randint(0, ROWS, (4 * 64 * 5,), generator=generator),
        lengths=torch.full((4 * 64,), 5))
    dmp(kjt).backward()
    (ddp,) = [m for m in dmp.modules() if isinstance(m, torch.nn.parallel.DistributedDataParallel)]
    buckets = sum(int(b) for b in ddp._get_ddp_logging_data()["bucket_sizes"].split(", "))
    dense = {k: v for k, v in dmp.state_dict().items() if ".mlp." in f".{k}"}
    state = overlap_optim.get_optimizers(dmp).state_dict()["state"]
    held_dense = sum(_size(v) for v in dense.values()) + buckets + sum(
        _size(v, scalars=True) for key, entry in state.items() if ".mlp." in f".{key}" for v in entry.values())
    return {"reserved": reserved / weight, "dense": held_dense / weight, "held": (held_bytes(dmp) + held_dense) / weight,
            "mlp_keys": sorted(k for k in state if "mlp" in k)}


def state_sizes(rank, world_size, cases, sharding_type, rows=256, dim=16, collection="ebc"):
    """Every case as a table of one EBC (``collection="ec"``: EC) on ``sharding_type`` (those it accepts); after one step,
    per table: (bytes this rank holds of its weights and optimizer state, the planner's figure for
    them: the local shards' weights plus ``TableKernel.state_bytes`` of each)."""
    from _sharded_parity import _accepted_on

    kept = [c for c in cases if _accepted_on(c, sharding_type)]
    config, module, sharder, attr = (
        (EmbeddingBagConfig, EmbeddingBagCollection, sharders.EmbeddingBagCollectionSharder(), "embedding_bags")
        if collection == "ebc" else (EmbeddingConfig, EmbeddingCollection, sharders.EmbeddingCollectionSharder(), "embeddings"))
    tables_module = module(tables=[
        config(name=n, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f_{n}"]) for n, _, _ in kept])
    for name, cls, kwargs in kept:
        overlap_optim.apply_optimizer_in_backward(cls, [getattr(tables_module, attr)[name].weight], kwargs)
    model = torch.nn.Sequential(tables_module)
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints={n: ParameterConstraints(sharding_types=[sharding_type], min_partition=4) for n, _, _ in kept},
    )
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    names = [c[0] for c in kept]
    generator = torch.Generator().manual_seed(rank)
    kjt = KeyedJaggedTensor.from_lengths_sync(  # every row of every table, on every rank
        keys=[f"f_{n}" for n in names], values=torch.cat([torch.randperm(rows, generator=generator) for _ in names]),
        lengths=torch.full((len(names),), rows))
    looked_up = dmp(kjt)
    looked_up = looked_up.to_dict() if hasattr(looked_up, "to_dict") else looked_up  # EBC: KeyedTensor; EC: dict
    (sum(v.values().sum() if hasattr(v, "lengths") else v.sum() for v in looked_up.values()) * 1e-3).backward()
    weights, state = dmp.state_dict(), overlap_optim.get_optimizers(dmp).state_dict()["state"]
    tables = sharders.plan_of(dmp.module[0]).tables
    out = {}
    for name in names:
        key = f"0.{attr}.{name}.weight"
        if tables[name].sharded_state:  # each local shard's own state objects, as the kernel holds them
            held_state = [v for piece in tables[name].shards for v in piece.state.state.values()]
        else:  # data-parallel: the weight's optimizer, whole on every rank
            held_state = list(state.get(key, {}).values())
        unique = {id(v): v for v in held_state if torch.is_tensor(v)}
        held = _size(weights[key]) + sum(_size(v, scalars=True) for v in unique.values())
        estimate = sum(_size(s.tensor) + tables[name].state_bytes(tuple(s.tensor.shape))
                       for s in _local(weights[key]))
        out[name] = (held, estimate)
    return out


def _local(value):
    if isinstance(value, ShardedTensor):
        return value.local_shards()
    return [type("Shard", (), {"tensor": value})()]


def _size(value, scalars=False):
    if isinstance(value, ShardedTensor):
        return sum(s.tensor.numel() * s.tensor.element_size() for s in value.local_shards())
    if torch.is_tensor(value) and (value.dim() or scalars):
        return value.numel() * value.element_size()
    return 0
