"""2D sparse parallelism (TorchRec's ``DMPCollection``) is refused, on every rank, before anything is sharded.

``DMPCollection`` shards the tables within each sharding group and replicates the groups; its
``sync()`` averages the replicas. It averages only FBGEMM's fused kernels' weights and, of their
state, only ``sum``: the state of every other kind (Adam's moments on the fallback, a cross-shard
table's factors, SGD's momentum) would drift between replicas, and our end-of-backward rounds would
reduce across replicas on the global group. Its environment, a ``ShardingEnv2D``, reaches our
sharders and data-parallel wrappers first, so they refuse it there.
"""

from __future__ import annotations

from typing import Any

from torchrec.distributed.types import ShardingEnv2D

__all__ = ["refuse_two_dimensional"]


def refuse_two_dimensional(env: Any) -> None:
    """Raise ``NotImplementedError`` if ``env`` (a sharder's or wrapper's sharding environment) is
    2D; see the module doc."""
    if isinstance(env, ShardingEnv2D):
        raise NotImplementedError(
            f"2D sparse parallelism (DMPCollection: sharding groups of {env.world_size} of {env.global_world_size} "
            "ranks) with overlap-optim's sharders or data-parallel wrappers: DMPCollection.sync() averages only FBGEMM's "
            "fused kernels and their 'sum' state, so the optimizer state of the other tables would drift between "
            "replicas, and the end-of-backward rounds would reduce across replicas. Shard with "
            "DistributedModelParallel over every rank"
        )
