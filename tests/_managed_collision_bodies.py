"""Rank bodies for tests/test_managed_collision.py (spawned; not collected by pytest).

The refusals: each builds a model with a ``ManagedCollisionEmbeddingBagCollection``,
meets it with one of our entry points, and returns what the test asserts: the error (type and
message, or "no error") and whether any module of the model was sharded by then.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner as StockPlanner
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.types import ShardedModule, ShardingEnv
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule

import overlap_optim
import sharders


class _Model(nn.Module):
    """An MC-EBC over table ``t`` (feature ``f``), and a plain EBC over ``u`` (feature ``g``)."""

    def __init__(self) -> None:
        super().__init__()
        ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=16,
                                                                feature_names=["f"])])
        collision = ManagedCollisionCollection(
            managed_collision_modules={"t": MCHManagedCollisionModule(
                zch_size=16, device=torch.device("cpu"), eviction_interval=1,
                eviction_policy=DistanceLFU_EvictionPolicy())},
            embedding_configs=ebc.embedding_bag_configs(),
        )
        self.mc = ManagedCollisionEmbeddingBagCollection(ebc, collision, return_remapped_features=False)
        self.plain = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="u", embedding_dim=8, num_embeddings=16,
                                                                       feature_names=["g"])])
        for table in (self.mc._embedding_module.embedding_bags["t"], self.plain.embedding_bags["u"]):
            overlap_optim.apply_optimizer_in_backward(torch.optim.Adagrad, table.parameters(), {"lr": 0.1})


def _outcome(build) -> dict:
    return _outcome_of(_Model(), build)


def _topology(world_size: int) -> Topology:
    return Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size)


def our_sharder_on_the_inner_collection(rank: int, world_size: int) -> dict:
    """A stock plan for the plain EBC and the MC module's inner EBC, both by our EBC sharder, under
    DMP: the plain one would be sharded first."""
    sharder = sharders.EmbeddingBagCollectionSharder()

    def build(model: nn.Module) -> None:
        constraints = {n: ParameterConstraints(sharding_types=["table_wise"]) for n in ("t", "u")}
        plan = StockPlanner(topology=_topology(world_size), constraints=constraints).collective_plan(
            model, [sharder], dist.group.WORLD)
        DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    return _outcome(build)


def inside_torchrecs_managed_collision_sharder(rank: int, world_size: int) -> dict:
    """TorchRec's MC sharder built on our EBC sharder, called by hand as TorchRec's own tests do (no
    DMP): it hands our sharder the inner EBC."""
    from torchrec.distributed.types import ParameterSharding

    sharder = ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=sharders.EmbeddingBagCollectionSharder())

    def build(model: nn.Module) -> None:
        params = {"t": ParameterSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[0])}
        env = ShardingEnv.from_process_group(dist.group.WORLD)
        model.mc = sharder.shard(model.mc, params, env, torch.device("cpu"), module_fqn="mc")
    return _outcome(build)


def our_planner(rank: int, world_size: int) -> dict:
    """Our planner, with TorchRec's MC sharder beside ours: refused at planning, on every rank."""
    def build(model: nn.Module) -> None:
        planner = sharders.EmbeddingShardingPlanner(topology=_topology(world_size))
        planner.collective_plan(model, [sharders.EmbeddingBagCollectionSharder(),
                                        ManagedCollisionEmbeddingBagCollectionSharder()], dist.group.WORLD)
    return _outcome(build)


def _ours_on(model: nn.Module, world_size: int, planner: str) -> None:
    """Our managed-collision sharder under DMP, planned by ``planner`` ("ours" or "stock")."""
    mc = sharders.ManagedCollisionEmbeddingBagCollectionSharder()
    topology = _topology(world_size)
    constraints = {"t": ParameterConstraints(sharding_types=["row_wise"])}
    if planner == "ours":
        plan = sharders.EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
            model, [mc], dist.group.WORLD)
    else:
        plan = _hand_made_plan(model, world_size)
    DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[mc])


def _hand_made_plan(model: nn.Module, world_size: int, sharder=None):
    """A row_wise plan of ``mc`` built by hand (TorchRec's plan helpers), so that no planner checks it."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    module_plan = construct_module_sharding_plan(
        model.mc, per_param_sharding={"t": row_wise()},
        sharder=sharder or sharders.ManagedCollisionEmbeddingBagCollectionSharder(),
        local_size=world_size, world_size=world_size, device_type="cpu")
    return ShardingPlan({"mc": module_plan})


def _mc_model(annotate) -> nn.Module:
    from _managed_collision_exact import MCModel

    model = MCModel(bagged=True)
    annotate(model.table(model.mc._embedding_module).weight)
    return model


def _outcome_of(model: nn.Module, build) -> dict:
    try:
        build(model)
        error = "no error"
    except Exception as err:  # what the user sees
        error = f"{type(err).__name__}: {err}"
    return {"error": error, "sharded": [p for p, m in model.named_modules() if isinstance(m, ShardedModule)]}


def column_state(rank: int, world_size: int, planner: str) -> dict:
    """Adafactor (a column factor) on the table of our managed-collision sharder: refused by name,
    by our planner, or (a plan made by hand) before DMP shards anything."""
    model = _mc_model(lambda w: overlap_optim.apply_optimizer_in_backward(torch.optim.Adafactor, [w], {"lr": 0.01}))
    return _outcome_of(model, lambda m: _ours_on(m, world_size, planner))


def unannotated(rank: int, world_size: int) -> dict:
    """A table of our managed-collision sharder with no annotation: refused by name before sharding."""
    model = _mc_model(lambda w: None)
    return _outcome_of(model, lambda m: _ours_on(m, world_size, "stock"))


def torchrecs_collection_sharder_inside_ours(rank: int, world_size: int) -> dict:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as Stock

    return _outcome_of(nn.Module(), lambda m: sharders.ManagedCollisionEmbeddingBagCollectionSharder(Stock()))


def torchrecs_sharder_under_our_wrapper(rank: int, world_size: int) -> dict:
    """TorchRec's managed-collision sharder (over its own EBC sharder) under DMP with our
    DataParallelWrapper, planned by TorchRec's planner: nothing of ours runs before DMP shards the
    collection, so the wrapper refuses it, by name, before the model trains."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as Stock

    def build(model: nn.Module) -> None:
        stock = [ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=Stock()), Stock()]
        plan = _hand_made_plan(model, world_size, stock[0])
        DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=stock,
                                 data_parallel_wrapper=sharders.DataParallelWrapper())
    from _managed_collision_exact import MCModel

    return _outcome_of(MCModel(bagged=True), build)
