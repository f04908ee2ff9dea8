"""Pooled and unpooled lookups: where each looked-up value sits in a kernel's output.

The two collections differ here and nowhere else in the kernels:

- an ``EmbeddingBagCollection`` kernel pools: one output row per sample, each
  feature's bag in its own columns (``[batch, sum of dims]``);
- an ``EmbeddingCollection`` kernel does not: one output row per id, in the
  order of the ids (feature-major), every table of the kernel as wide
  (``[ids, dim]``).

Every kernel that turns an output gradient back into rows (the fallback, the
held fused backward, the fused norm) asks this module, so none of them branches
on the collection.

FBGEMM's dense TBE on CPU pools even when told not to (``PoolingMode.NONE``
returns bag sums), so TorchRec's dense EC kernels look up the wrong rows there.
:func:`unpooled_lookup` is the lookup those kernels run instead (a gather of
rows, differentiable, exact on any device).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

__all__ = [
    "is_pooled", "feature_spans", "table_views", "unpooled_lookup", "pooled_lookup", "read_rows", "LOW_PRECISION",
    "value_grads", "variable_batch_lookup",
    "variable_batch_grads",
    "concatenate_lookups", "Lookup",
]

Lookup = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # indices, offsets, per-sample weights


def is_pooled(pooling_mode: PoolingMode) -> bool:
    """True for SUM and MEAN (an EBC's kernels), False for NONE (an EC's)."""
    return pooling_mode != PoolingMode.NONE


def feature_spans(offsets: torch.Tensor, features: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each feature's ids in a lookup's ``indices`` (feature-major, every
    feature with the same number of bags)."""
    batch = (offsets.numel() - 1) // features
    bounds = offsets[:: max(batch, 1)].tolist() if batch else [0] * (features + 1)
    return list(zip(bounds, bounds[1:]))


def table_views(emb: torch.nn.Module) -> list[torch.Tensor]:
    """Each table's ``(rows, dim)`` view of a dense FBGEMM TBE's flat ``weights``, in the graph
    (FBGEMM's ``split_embedding_weights`` detaches them)."""
    flat, offsets = emb.weights, emb.weights_physical_offsets
    return [flat[offsets[t] : offsets[t] + rows * dim].view(rows, dim) for t, (rows, dim) in enumerate(emb.embedding_specs)]


def unpooled_lookup(
    tables: list[torch.Tensor], feature_table_map: list[int], indices: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """``[ids, dim]``: the row of every id, in order, from ``tables`` (each table's ``(rows, dim)``
    weight), read by :func:`read_rows`. Differentiable in ``tables``."""
    spans = feature_spans(offsets, len(feature_table_map))
    parts = [read_rows(tables[t], indices[s:e]) for t, (s, e) in zip(feature_table_map, spans)]
    if not parts:
        return tables[0].new_zeros(0, tables[0].shape[1]).float() if tables else torch.zeros(0, 0)
    return torch.cat(parts)


def value_grads(
    pooling_mode: PoolingMode,
    feature_table_map: list[int],
    dims: list[int],
    grad_out: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    batches: list[list[int]] | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """Per feature: (its ids, the gradient each id's row gets from this lookup, its table index).
    ``dims``: each table's width. ``batches``: for a batch with a variable batch size per feature
    (VBE, pooled), each feature's number of bags from each rank (``stride_per_key_per_rank``);
    ``grad_out`` is then FBGEMM's flat VBE output layout (:func:`variable_batch_grads`)."""
    if batches is not None:
        yield from _variable_batch_value_grads(pooling_mode, feature_table_map, dims, grad_out, indices, offsets,
                                               weights, batches)
        return
    features = len(feature_table_map)
    batch = (offsets.numel() - 1) // features
    if batch == 0:
        return
    spans = feature_spans(offsets, features)
    if not is_pooled(pooling_mode):
        for (start, end), table in zip(spans, feature_table_map):
            yield indices[start:end], grad_out[start:end, : dims[table]], table
        return
    lengths = offsets[1:] - offsets[:-1]
    bag_of_value = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)
    column = 0
    for f, ((start, end), table) in enumerate(zip(spans, feature_table_map)):
        dim = dims[table]
        samples = bag_of_value[start:end] - f * batch
        grads = grad_out[:, column : column + dim].index_select(0, samples)  # no copy of the columns first
        if weights is not None:
            grads = grads * weights[start:end, None]
        if pooling_mode == PoolingMode.MEAN:
            grads = grads / lengths[f * batch + samples].clamp(min=1)[:, None]
        column += dim
        yield indices[start:end], grads, table


def variable_batch_lookup(
    tables: list[torch.Tensor], feature_table_map: list[int], indices: torch.Tensor, offsets: torch.Tensor,
    weights: torch.Tensor | None, batches: list[list[int]], pooling_mode: PoolingMode,
) -> torch.Tensor:
    """FBGEMM's flat VBE output of a pooled lookup (rank after rank, feature after feature, each
    feature's bags from that rank), from ``tables`` (each table's ``(rows, dim)`` weight).
    FBGEMM's dense TBE on CPU ignores ``batch_size_per_feature_per_rank`` (it returns
    ``[bags / features, sum of dims]``), so the fallback pools each feature itself."""
    pooled = _pool_features(tables, feature_table_map, indices, offsets, weights, [sum(b) for b in batches],
                            pooling_mode)
    parts, row = [], [0] * len(pooled)
    for rank in range(len(batches[0]) if batches else 0):
        for f, per_rank in enumerate(batches):
            parts.append(pooled[f][row[f] : row[f] + per_rank[rank]].reshape(-1))
            row[f] += per_rank[rank]
    return torch.cat(parts) if parts else indices.new_zeros(0, dtype=torch.float32)


def pooled_lookup(
    tables: list[torch.Tensor], feature_table_map: list[int], indices: torch.Tensor, offsets: torch.Tensor,
    weights: torch.Tensor | None, pooling_mode: PoolingMode,
) -> torch.Tensor:
    """``[batch, sum of dims]``: a pooled lookup as FBGEMM's TBE gives it, in plain torch, each
    row read in float32 (:func:`read_rows`): the lookup of tables whose weights FBGEMM's CPU kernels
    cannot read (BF16), or would pool otherwise than the float32 reference."""
    features = len(feature_table_map)
    batch = (offsets.numel() - 1) // features if features else 0
    pooled = _pool_features(tables, feature_table_map, indices, offsets, weights, [batch] * features, pooling_mode)
    return torch.cat(pooled, dim=1) if pooled else indices.new_zeros(batch, 0, dtype=torch.float32)


def read_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of ``table``, in float32 when the table holds a lower precision (FP16, BF16):
    every lookup and every update of a low-precision table computes in float32 on the rows as
    stored, and rounds once, when an update writes them back."""
    rows = table.index_select(0, ids.long())
    return rows.float() if rows.dtype in LOW_PRECISION else rows


LOW_PRECISION = (torch.float16, torch.bfloat16)


def _pool_features(
    tables: list[torch.Tensor], feature_table_map: list[int], indices: torch.Tensor, offsets: torch.Tensor,
    weights: torch.Tensor | None, bags_per_feature: list[int], pooling_mode: PoolingMode,
) -> list[torch.Tensor]:
    """Each feature's ``[bags, dim]`` pooled rows (its bags follow the previous feature's)."""
    lengths = offsets[1:] - offsets[:-1]
    bag_of_value = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)
    pooled, first_bag = [], 0
    for table, bags in zip(feature_table_map, bags_per_feature):
        start, end = int(offsets[first_bag]), int(offsets[first_bag + bags])
        rows = read_rows(tables[table], indices[start:end])
        if weights is not None:
            rows = rows * weights[start:end, None]
        sums = rows.new_zeros(bags, rows.shape[1]).index_add_(0, bag_of_value[start:end] - first_bag, rows)
        if pooling_mode == PoolingMode.MEAN:
            sums /= lengths[first_bag : first_bag + bags].clamp(min=1)[:, None]
        pooled.append(sums)
        first_bag += bags
    return pooled


def variable_batch_grads(grad_out: torch.Tensor, batches: list[list[int]], dims: list[int]) -> list[torch.Tensor]:
    """Each feature's ``[bags, dim]`` block of FBGEMM's flat VBE output (or its gradient): rank
    after rank, and within a rank feature after feature, ``batches[f][r]`` rows of ``dims[f]``.
    A feature's bags come out rank after rank, as in the lookup's offsets."""
    blocks: list[list[torch.Tensor]] = [[] for _ in batches]
    start = 0
    for rank in range(len(batches[0]) if batches else 0):
        for f, per_rank in enumerate(batches):
            size = per_rank[rank] * dims[f]
            blocks[f].append(grad_out[start : start + size].view(per_rank[rank], dims[f]))
            start += size
    assert start == grad_out.numel(), f"a VBE output of {grad_out.numel()} values for {start}"
    return [torch.cat(b) if len(b) > 1 else b[0] for b in blocks]


def _variable_batch_value_grads(
    pooling_mode: PoolingMode, feature_table_map: list[int], dims: list[int], grad_out: torch.Tensor,
    indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, batches: list[list[int]],
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    assert is_pooled(pooling_mode), "a VBE lookup is pooled"
    per_feature = variable_batch_grads(grad_out, batches, [dims[t] for t in feature_table_map])
    lengths = offsets[1:] - offsets[:-1]
    bag_of_value = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)
    first_bag = 0
    for f, table in enumerate(feature_table_map):
        bags = sum(batches[f])
        start, end = int(offsets[first_bag]), int(offsets[first_bag + bags])
        bag = bag_of_value[start:end]
        grads = per_feature[f].index_select(0, bag - first_bag)
        if weights is not None:
            grads = grads * weights[start:end, None]
        if pooling_mode == PoolingMode.MEAN:
            grads = grads / lengths[bag].clamp(min=1)[:, None]
        first_bag += bags
        yield indices[start:end], grads, table


def concatenate_lookups(
    window: list[tuple[Lookup, torch.Tensor]], features: int, pooling_mode: PoolingMode
) -> tuple[Lookup, torch.Tensor]:
    """One lookup over a window's micro-batches (feature-major: each feature's bags of every
    micro-batch, in order), and its output gradient: the micro-batches' sample rows in order
    (pooled), or each feature's id rows of every micro-batch in order (unpooled)."""
    index_parts, weight_parts, length_parts, grad_parts = [], [], [], []
    for f in range(features):
        for (indices, offsets, weights), grad in window:
            batch = (offsets.numel() - 1) // features
            start, end = int(offsets[f * batch]), int(offsets[(f + 1) * batch])
            index_parts.append(indices[start:end])
            if weights is not None:
                weight_parts.append(weights[start:end])
            length_parts.append(offsets[f * batch + 1 : (f + 1) * batch + 1] - offsets[f * batch : (f + 1) * batch])
            if not is_pooled(pooling_mode):
                grad_parts.append(grad[start:end])
    offsets = window[0][0][1]
    lengths = torch.cat(length_parts)
    joined = torch.cat([offsets.new_zeros(1), torch.cumsum(lengths, 0).to(offsets.dtype)])
    has_weights = window[0][0][2] is not None
    assert all((w[0][2] is not None) == has_weights for w in window), "per-sample weights in some micro-batches only"
    weights = torch.cat(weight_parts) if has_weights else None
    grad = torch.cat(grad_parts) if grad_parts else torch.cat([grad for _, grad in window])
    return (torch.cat(index_parts), joined, weights), grad
