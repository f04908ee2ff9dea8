"""EmbeddingCollection tables against stock TorchRec's EC (2 ranks, gloo, table_wise).

The measurement of :mod:`benchmarks.sparse_vs_torchrec` with the tables in an
``EmbeddingCollection``: 20 ids per sample looked up unpooled, the head on each
id's row. Settings where stock TorchRec's EC trains correctly on CPU: fused SGD,
Adagrad with eps given, row-wise Adagrad; no dense in-backward optimizer.
"""

from __future__ import annotations

from benchmarks import sparse_vs_torchrec


def run(quick: bool) -> dict:
    """Measure; returns a JSON-able result with ratios (ours / stock, target <= 0.8)."""
    return sparse_vs_torchrec.run(quick, collection="ec")
