"""TorchRec integration of overlap-optim: optimizer-aware sharders.

The EmbeddingBagCollection sharder, its optimizer decision table, the fallback
kernel, ``DataParallelWrapper`` and ``describe()`` land here. Arrows run from
``sharders`` to ``overlap_optim``, never back.
"""

__all__: list[str] = []
