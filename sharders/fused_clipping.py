"""Fused tables clipped by norm: the norm rebuilt from the output gradient.

FBGEMM's fused backward forms each touched row's gradient and applies the update
in one kernel; no gradient comes out between the two, so nothing can be clipped
there (its own ``gradient_clipping`` clamps the pooled output gradient, which is
neither ``clip_grad_norm_`` nor ``clip_grad_value_``). Clipping by norm only
multiplies the whole gradient by one coefficient, and a table's gradient is
linear in the kernel's output gradient. So a fused kernel in a clipping set
(:mod:`overlap_optim.clipping`) runs in two halves:

1. in backward, this rank's part of the norm is rebuilt from the output gradient
   and the lookup's ids: each touched row's summed gradient (duplicate ids added,
   per-sample weights and mean pooling applied), then ``sum |g|^p`` (``max |g|``
   for inf) over those rows. It goes to the set's round with
   :meth:`~overlap_optim.clipping.GradientClipping.hold`;
2. at the end of backward, once the global norm is known, FBGEMM's own backward
   runs on the output gradient times the coefficient: its exact update of the
   clipped gradient (:mod:`sharders.fused_backward` holds it back).

What it costs: a sort of the batch's ids and one ``[touched rows, dim]`` sum per
step, beside FBGEMM's own backward. What it holds until the end of backward: the
output gradient (``[batch, dims]``) and what the lookup saved (its ids).

Clipping by value clamps each element of a row's summed gradient, which is not
linear in the output gradient: those tables run in the fallback
(:mod:`sharders.optimizer_table`).
"""

from __future__ import annotations

import math

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn

from sharders.pooling import is_pooled

__all__ = ["row_partial_norm"]


def row_partial_norm(
    emb: nn.Module,
    grad: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    norm_type: float,
) -> torch.Tensor:
    """``sum |g|^p`` (``max |g|`` for inf) over the summed gradients of the rows a TBE lookup
    touched, from its output gradient ``grad`` (``[batch, dims]`` pooled, ``[ids, dim]``
    unpooled): what the kernel's tables' coalesced gradients add to the norm. One float64 element.

    The ids are sorted once; then, a cache-sized chunk of whole rows at a time, each id's
    bag gradient is gathered, weighted, summed per row and normed. Neither one row per id
    nor ``[touched rows, dim]`` is ever held whole.
    """
    if indices.numel() == 0:  # this rank's shards got no id (a row shard the batch did not reach)
        return torch.zeros(1, dtype=torch.float64, device=grad.device)
    features = len(emb.feature_table_map)
    batch = (offsets.numel() - 1) // features
    starts = offsets.tolist()[:: max(batch, 1)]  # where each feature's ids start (feature-major)
    lengths = (offsets[1:] - offsets[:-1]).long()
    bag = torch.repeat_interleave(torch.arange(features * batch, device=grad.device), lengths, output_size=indices.numel())
    rows = indices.long().clone()  # one id space over the kernel's tables (features of one table share it)
    for f, base in enumerate(emb.hash_size_cumsum.tolist()[:features]):
        rows[starts[f] : starts[f + 1]] += base
    if not is_pooled(emb.pooling_mode):  # each id's own output row is its gradient
        source = torch.arange(indices.numel(), device=grad.device)
        return _sorted_row_partial(grad.reshape(indices.numel(), -1), rows, source, None, norm_type).reshape(1)
    weights = None if per_sample_weights is None else per_sample_weights.to(grad.dtype)
    if emb.pooling_mode == PoolingMode.MEAN:
        inverse = 1.0 / lengths[bag].to(grad.dtype)
        weights = inverse if weights is None else weights * inverse
    d_offsets = emb.D_offsets.tolist()
    dims = [b - a for a, b in zip(d_offsets, d_offsets[1:])]
    per_sample = grad.reshape(batch, -1)
    partials = []
    for dim in sorted(set(dims)):
        mine = [f for f in range(features) if dims[f] == dim]
        # one row per bag of these features: [len(mine) * batch, dim], in their order
        bag_grads = torch.stack([per_sample[:, d_offsets[f] : d_offsets[f] + dim] for f in mine]).reshape(-1, dim)
        if len(mine) == features:
            ids, source, scale = rows, bag, weights
        else:
            keep = torch.cat([torch.arange(starts[f], starts[f + 1], device=grad.device) for f in mine])
            renumber = torch.full((features * batch,), -1, dtype=torch.long, device=grad.device)
            for k, f in enumerate(mine):
                renumber[f * batch : (f + 1) * batch] = torch.arange(k * batch, (k + 1) * batch, device=grad.device)
            ids, source = rows[keep], renumber[bag[keep]]
            scale = None if weights is None else weights[keep]
        partials.append(_sorted_row_partial(bag_grads, ids, source, scale, norm_type))
    if not partials:
        return torch.zeros(1, dtype=torch.float64, device=grad.device)
    stacked = torch.stack(partials)
    return (stacked.max() if math.isinf(norm_type) else stacked.sum()).reshape(1)


_CHUNK = 4096  # ids per chunk: few enough that their gathered gradients stay in cache, enough to amortise each chunk


def _sorted_row_partial(
    bag_grads: torch.Tensor, ids: torch.Tensor, source: torch.Tensor, scale: torch.Tensor | None, norm_type: float
) -> torch.Tensor:
    """The partial of the rows ``ids`` name, row r's gradient being the sum over ``ids == r`` of
    ``scale * bag_grads[source]``.

    A row named once is its bag's gradient times the weight, so its ``|g|^p`` sum is
    ``|w|^p`` times the bag's, computed once per bag; only rows named several times are
    gathered and summed."""
    count = ids.numel()
    if count == 0:
        return torch.zeros((), dtype=torch.float64, device=bag_grads.device)
    ids, order = torch.sort(ids)
    source = source.index_select(0, order)
    scale = None if scale is None else scale.index_select(0, order)
    new_row = torch.ones(count + 1, dtype=torch.bool, device=ids.device)
    new_row[1:count] = ids[1:] != ids[:-1]
    single = new_row[:-1] & new_row[1:]  # the row starts here and the next id starts another
    new_row = new_row[:-1]
    singles, several = single.nonzero().squeeze(1), (~single).nonzero().squeeze(1)
    inf = math.isinf(norm_type)
    # rows named once: |w| * (the bag's |g|^p sum, or max |g|)
    bag_norms = torch.linalg.vector_norm(bag_grads, norm_type, dim=1)
    single_norms = bag_norms.index_select(0, source.index_select(0, singles))
    if scale is not None:
        single_norms = single_norms * scale.index_select(0, singles).abs()
    if inf:
        total = (single_norms.max() if singles.numel() else single_norms.new_zeros(())).double()
    else:
        total = single_norms.double().pow(norm_type).sum()
    # rows named several times: gathered, summed, normed, a cache-sized chunk of whole rows at a time
    if several.numel():
        firsts = new_row.index_select(0, several)
        source, row_of = source.index_select(0, several), firsts.cumsum(0) - 1
        scale = None if scale is None else scale.index_select(0, several)
        for begin, end in _chunks(firsts):
            values = bag_grads.index_select(0, source[begin:end])
            if scale is not None:
                values.mul_(scale[begin:end].unsqueeze(1))
            local = row_of[begin:end] - row_of[begin]
            summed = values.new_zeros(int(local[-1]) + 1, values.shape[1]).index_add_(0, local, values)
            part = _partial(summed, norm_type)
            total = torch.maximum(total, part) if inf else total + part
    return total


def _chunks(new_row: torch.Tensor) -> list[tuple[int, int]]:
    """``(begin, end)`` spans of about ``_CHUNK`` sorted ids that start at a row's first id,
    so that no row is cut in two."""
    count = new_row.numel()
    row_starts = new_row.nonzero().squeeze(1)
    wanted = torch.tensor(list(range(_CHUNK, count, _CHUNK)), dtype=torch.long, device=new_row.device)
    cuts = row_starts[torch.searchsorted(row_starts, wanted).clamp(max=row_starts.numel() - 1)]
    bounds = [0] + sorted({c for c in cuts.tolist() if 0 < c < count}) + [count]
    return list(zip(bounds, bounds[1:]))


def _partial(summed: torch.Tensor, norm_type: float) -> torch.Tensor:
    if summed.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=summed.device)
    norm = torch.linalg.vector_norm(summed, norm_type).double()
    return norm if math.isinf(norm_type) else norm**norm_type
