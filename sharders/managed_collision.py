"""The managed-collision (ZCH) sharders: TorchRec's, over our collection sharders.

:class:`ManagedCollisionEmbeddingBagCollectionSharder` and
:class:`ManagedCollisionEmbeddingCollectionSharder` shard ``ManagedCollisionEmbeddingBagCollection``
and ``ManagedCollisionEmbeddingCollection``. TorchRec remaps each id through the table's
managed-collision module, row shard by row shard (row_wise, the one sharding type TorchRec's
remapping runs on; our planner offers it on CPU), and evicts as stock does; our collection sharder
runs the tables, and an evicted slot gets a fresh row's weight and optimizer state
(:mod:`sharders.evictions`, which also lists what is refused).
"""

from __future__ import annotations

from typing import Any

from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder as _TorchRecECSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder as _TorchRecEBCSharder
from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder

from sharders.collection import CollectionSharder
from sharders.embedding import EmbeddingCollectionSharder
from sharders.embeddingbag import EmbeddingBagCollectionSharder
from sharders.evictions import EvictingSharder, EvictingBagCollection, EvictingEmbeddingCollection

__all__ = ["ManagedCollisionEmbeddingBagCollectionSharder", "ManagedCollisionEmbeddingCollectionSharder"]


def _own(sharder: EvictingSharder, inner: Any, name: str, remapping: Any) -> None:
    """Keep ``inner`` (our collection sharder, else ValueError naming it) and ``remapping`` (TorchRec's
    remapping sharder, made when None) on ``sharder``."""
    if not isinstance(inner, CollectionSharder):
        expected = "EmbeddingBagCollectionSharder" if name == "ebc_sharder" else "EmbeddingCollectionSharder"
        raise ValueError(
            f"{type(sharder).__name__}: {name} must be overlap-optim's collection sharder (sharders.{expected}), "
            f"not {type(inner).__name__}: another one leaves an evicted slot's optimizer state to its new id"
        )
    sharder.collection_sharder, sharder.remapping_sharder = inner, remapping or ManagedCollisionCollectionSharder()


class ManagedCollisionEmbeddingBagCollectionSharder(EvictingSharder, _TorchRecEBCSharder):
    """TorchRec's ``ManagedCollisionEmbeddingBagCollectionSharder`` over our
    :class:`~sharders.EmbeddingBagCollectionSharder` (the default ``ebc_sharder``); see the module doc.

    Example:
        >>> sharders_ = [sharders.EmbeddingBagCollectionSharder(), ManagedCollisionEmbeddingBagCollectionSharder()]
        >>> plan = sharders.EmbeddingShardingPlanner(topology=topology).collective_plan(model, sharders_, pg)
        >>> model = DistributedModelParallel(model, plan=plan, sharders=sharders_)
    """

    sharded_class = EvictingBagCollection

    def __init__(self, ebc_sharder: Any = None, mc_sharder: Any = None, **kwargs: Any) -> None:
        ebc_sharder = ebc_sharder if ebc_sharder is not None else EmbeddingBagCollectionSharder()
        _own(self, ebc_sharder, "ebc_sharder", mc_sharder)
        super().__init__(ebc_sharder=ebc_sharder, mc_sharder=self.remapping_sharder, **kwargs)


class ManagedCollisionEmbeddingCollectionSharder(EvictingSharder, _TorchRecECSharder):
    """TorchRec's ``ManagedCollisionEmbeddingCollectionSharder`` over our
    :class:`~sharders.EmbeddingCollectionSharder` (the default ``ec_sharder``); see the module doc."""

    sharded_class = EvictingEmbeddingCollection

    def __init__(self, ec_sharder: Any = None, mc_sharder: Any = None, **kwargs: Any) -> None:
        ec_sharder = ec_sharder if ec_sharder is not None else EmbeddingCollectionSharder()
        _own(self, ec_sharder, "ec_sharder", mc_sharder)
        super().__init__(ec_sharder=ec_sharder, mc_sharder=self.remapping_sharder, **kwargs)
