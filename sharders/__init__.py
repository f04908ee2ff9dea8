"""TorchRec integration of overlap-optim: optimizer-aware sharders.

Arrows run from ``sharders`` to ``overlap_optim``, never back.
"""

from sharders.data_parallel import DataParallelWrapper, FullyShardWrapper
from sharders.describe import describe
from sharders.embedding import EmbeddingCollectionSharder
from sharders.embeddingbag import EmbeddingBagCollectionSharder
from sharders.managed_collision import (
    ManagedCollisionEmbeddingBagCollectionSharder, ManagedCollisionEmbeddingCollectionSharder,
)
from sharders.kernels import KernelChoice, KernelKind, TableDecision, TableKernel
from sharders.optimizer_table import choose_kernel
from sharders.planner import EmbeddingShardingPlanner
from sharders.plan import ShardedModulePlan, plan_of
from sharders.storage_reservation import DenseStorageReservation, dense_bytes
from sharders.torchrec_checkpoint import from_torchrec

__all__ = [
    "DataParallelWrapper", "FullyShardWrapper", "DenseStorageReservation", "dense_bytes", "describe", "EmbeddingBagCollectionSharder", "EmbeddingCollectionSharder", "EmbeddingShardingPlanner", "KernelChoice", "KernelKind", "TableDecision",
    "ManagedCollisionEmbeddingBagCollectionSharder", "ManagedCollisionEmbeddingCollectionSharder",
    "TableKernel", "ShardedModulePlan", "choose_kernel", "plan_of", "from_torchrec",
]
