"""An EmbeddingBagCollection sharder that gives every table exactly its torch.optim update.

It is TorchRec's sharder with the changes of :mod:`sharders.collection` (the
decision table, the kernel kinds, data-parallel tables in a DDP hook, frozen
tables, ``fallback_tables=`` and ``dense_tables=``), and one more: row-wise and
table-row-wise sharding are offered on CPU too.

Fused and fallback tables are lazy: on a batch that leaves rows untouched,
those rows and their state do not change. ``dense_tables=`` names tables that
step every row of their shard on every batch instead (a zero gradient where
untouched), exactly as ``torch.optim`` on a dense ``nn.EmbeddingBag``; they
run in the fallback, at a cost that follows the shard's size. A whole table
whose optimizer is not row-separable runs with dense semantics in the fallback.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as _TorchRecSharder

from sharders import _private
from sharders._private import kernels_of
from sharders.collection import CollectionSharder
from sharders.kernels import ROW_SPLITTING, TableDecision
from sharders.optimizer_table import annotation_of

__all__ = ["EmbeddingBagCollectionSharder", "TableDecision", "annotation_of", "kernels_of"]


class EmbeddingBagCollectionSharder(CollectionSharder, _TorchRecSharder):
    """Drop-in for TorchRec's ``EmbeddingBagCollectionSharder`` (its arguments and
    :class:`~sharders.collection.CollectionSharder`'s); see the module doc.

    Example:
        >>> sharder = EmbeddingBagCollectionSharder()
        >>> plan = EmbeddingShardingPlanner(topology=topology).collective_plan(model, [sharder], pg)
        >>> model = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
    """

    tables_attr = "embedding_bags"

    def table_configs(self, module: nn.Module) -> list[Any]:
        return module.embedding_bag_configs()

    def adapt_kernels(self, sharded: nn.Module) -> None:
        """TorchRec divides every feature of a module that has a row-split MEAN table by its bag's
        length: only those are divided here (:func:`sharders._private.divide_only_row_split_means`).
        A lookup of several fallback kernels, or of several fused ones on CPU, joins their VBE outputs
        rank after rank (:func:`sharders._private.merge_variable_batches_by_rank`)."""
        _private.divide_only_row_split_means(sharded)
        _private.merge_variable_batches_by_rank(sharded)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = list(super().sharding_types(compute_device_type))
        return types + [t for t in ROW_SPLITTING if t not in types]
