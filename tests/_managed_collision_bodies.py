"""Rank bodies for tests/test_managed_collision.py (spawned; not collected by pytest).

Each builds a model whose EBC is wrapped in TorchRec's ``ManagedCollisionEmbeddingBagCollection``,
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
    model = _Model()
    try:
        build(model)
        error = "no error"
    except Exception as err:  # what the user sees
        error = f"{type(err).__name__}: {err}"
    return {"error": error, "sharded": [p for p, m in model.named_modules() if isinstance(m, ShardedModule)]}


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
