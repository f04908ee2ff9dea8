"""An EmbeddingCollection sharder that gives every table exactly its torch.optim update.

Sequence models (HSTU, BERT4Rec, SASRec) look up one embedding per id with
TorchRec's ``EmbeddingCollection`` (EC). This sharder is TorchRec's EC sharder
with the changes of :mod:`sharders.collection`: the same annotations, the same
decision table and kernel kinds, the same keyword arguments, ``get_optimizers``,
checkpoints, clipping and ``no_step``. Only the lookup differs (unpooled, see
:mod:`sharders.pooling`), and the kernels ask that module.

One repair: FBGEMM's dense TBE on CPU sums each bag even when told not to pool,
so TorchRec's dense EC kernels (data-parallel tables, unannotated tables) return
wrong rows there and crash in the output split. Each such kernel runs
:func:`sharders.pooling.unpooled_lookup` instead: a gather of rows, exact on
every device.

Sharding types: data_parallel, table_wise, column_wise and row_wise (TorchRec's).
``use_index_dedup=True`` is refused on CPU, where FBGEMM has no kernel for it.

A managed-collision collection takes :class:`sharders.ManagedCollisionEmbeddingCollectionSharder`
(:mod:`sharders.managed_collision`); this sharder on its inner collection is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec.distributed.batched_embedding_kernel import BatchedDenseEmbedding
from torchrec.distributed.embedding import EmbeddingCollectionSharder as _TorchRecSharder
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from sharders import _private
from sharders.collection import CollectionSharder
from sharders.pooling import table_views, unpooled_lookup

__all__ = ["EmbeddingCollectionSharder"]


class EmbeddingCollectionSharder(CollectionSharder, _TorchRecSharder):
    """Drop-in for TorchRec's ``EmbeddingCollectionSharder`` (its arguments and
    :class:`~sharders.collection.CollectionSharder`'s); see the module doc.

    Example:
        >>> ebc_sharder, ec_sharder = EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()
        >>> plan = EmbeddingShardingPlanner(topology=topology).collective_plan(model, [ebc_sharder, ec_sharder], pg)
        >>> model = DistributedModelParallel(model, plan=plan, sharders=[ebc_sharder, ec_sharder],
        ...                                  data_parallel_wrapper=DataParallelWrapper())
    """

    tables_attr = "embeddings"

    def table_configs(self, module: nn.Module) -> list[Any]:
        return module.embedding_configs()

    def check_options(self, device_type: str) -> None:
        if self.variable_batch:
            raise NotImplementedError(
                "EmbeddingCollectionSharder(variable_batch=True): batches with a variable batch size per feature "
                "are built for EmbeddingBagCollections here; leave variable_batch off for an EmbeddingCollection"
            )
        if _private.uses_index_dedup(self) and device_type == "cpu":
            raise NotImplementedError(
                "EmbeddingCollectionSharder(use_index_dedup=True) on CPU: TorchRec deduplicates ids with "
                "fbgemm's jagged_unique_indices, which FBGEMM builds for CUDA only; leave use_index_dedup off on CPU"
            )

    def adapt_kernels(self, sharded: nn.Module) -> None:
        """TorchRec's own dense EC kernels (data-parallel and unannotated tables) look up by
        gathering rows (see the module doc)."""
        for _, kernel in _private.kernels_of(sharded):
            if type(kernel) is BatchedDenseEmbedding:  # not one our kinds took over
                _private.recast_kernel(kernel, GatheringDenseEmbedding)


class GatheringDenseEmbedding(BatchedDenseEmbedding):
    """TorchRec's dense EC kernel with a lookup that does not pool (see the module doc)."""

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        layout = _private.dense_kernel_layout(self)
        return unpooled_lookup(table_views(self.emb_module), layout.feature_table_map, features.values(), features.offsets())



