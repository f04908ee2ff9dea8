"""TorchRec integration of overlap-optim: optimizer-aware sharders.

Arrows run from ``sharders`` to ``overlap_optim``, never back.
"""

from sharders.data_parallel import DataParallelWrapper
from sharders.describe import describe
from sharders.embeddingbag import EmbeddingBagCollectionSharder, TableDecision
from sharders.optimizer_table import KernelChoice, choose_kernel

__all__ = ["DataParallelWrapper", "describe", "EmbeddingBagCollectionSharder", "KernelChoice", "TableDecision", "choose_kernel"]
