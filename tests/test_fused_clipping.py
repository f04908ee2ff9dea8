"""Fused tables clipped by norm (``sharders.fused_clipping``, ``sharders.fused_backward``), in one
process, on FBGEMM's TBE itself.

The norm rebuilt from the output gradient is checked against torch's own gradient of the same
lookup (``F.embedding_bag`` on copies of the tables: duplicate ids, per-sample weights, mean
pooling, tables of different widths, a table read by two features). The held update is checked
against ``clip_grad_norm_`` then ``torch.optim.Adagrad`` / ``SGD`` on those copies, after every
step, with the bound at 0.3x the first norm. The 2-rank cases (row and column shards through the
sharder) are in ``test_clipping_sharded``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from overlap_optim import apply_gradient_clipping
from sharders import fused_clipping
from sharders.fused_backward import HeldBackward
from sharders.fused_clipping import row_partial_norm

ROWS = 30
BATCH = 5


def _tbe(dims, feature_table_map, pooling=PoolingMode.SUM, optimizer=EmbOptimType.EXACT_ADAGRAD, lr=0.1,
         precision=SparseType.FP32):
    specs = [(ROWS, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for d in dims]
    kwargs = {"eps": 1e-8} if optimizer == EmbOptimType.EXACT_ADAGRAD else {}
    return SplitTableBatchedEmbeddingBagsCodegen(
        specs, optimizer=optimizer, learning_rate=lr, feature_table_map=feature_table_map, pooling_mode=pooling,
        weights_precision=precision, **kwargs,
    )


def _batch(features, generator, weighted):
    """Per feature and sample 0-4 ids, half of them from 4 hot rows: rows named once and rows
    named many times, in one bag and across bags."""
    lengths = torch.randint(0, 5, (features * BATCH,), generator=generator)
    count = int(lengths.sum())
    hot = torch.rand(count, generator=generator) < 0.5
    indices = torch.where(hot, torch.randint(0, 4, (count,), generator=generator),
                          torch.randint(0, ROWS, (count,), generator=generator))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    weights = torch.rand(indices.numel(), generator=generator) + 0.5 if weighted else None
    return indices, offsets, weights


def _reference_lookup(tables, feature_table_map, indices, offsets, weights, mode):
    """torch's pooled lookup of each feature, concatenated as the TBE's output is."""
    outputs = []
    for f, t in enumerate(feature_table_map):
        start, end = int(offsets[f * BATCH]), int(offsets[(f + 1) * BATCH])
        bag_offsets = offsets[f * BATCH : (f + 1) * BATCH] - start
        psw = None if weights is None else weights[start:end]
        outputs.append(F.embedding_bag(indices[start:end], tables[t], bag_offsets, mode=mode, per_sample_weights=psw))
    return torch.cat(outputs, dim=1)


CASES = {
    "one_table": ([8], [0], PoolingMode.SUM, False),
    "weighted_shared_table": ([8, 8], [0, 1, 1], PoolingMode.SUM, True),
    "mean_pooling": ([8, 8], [0, 1], PoolingMode.MEAN, False),
    "mixed_widths": ([8, 4, 8], [0, 1, 2, 1], PoolingMode.SUM, True),
}


@pytest.mark.parametrize("chunk", [3, 4096])  # 3: rows of many ids meet chunk ends
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("case", list(CASES))
def test_the_rebuilt_norm_equals_torchs_gradient_norm(case, norm_type, chunk, monkeypatch):
    monkeypatch.setattr(fused_clipping, "_CHUNK", chunk)
    dims, ftm, pooling, weighted = CASES[case]
    if pooling == PoolingMode.MEAN:
        weighted = False  # per-sample weights need sum pooling in torch's embedding_bag
    emb = _tbe(dims, ftm, pooling)
    tables = [w.detach().clone().requires_grad_() for w in emb.split_embedding_weights()]
    indices, offsets, weights = _batch(len(ftm), torch.Generator().manual_seed(7), weighted)
    mode = "mean" if pooling == PoolingMode.MEAN else "sum"
    out = _reference_lookup(tables, ftm, indices, offsets, weights, mode)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected = torch.nn.utils.get_total_norm([t.grad for t in tables], norm_type).double()
    partial = row_partial_norm(emb, grad, indices, offsets, weights, norm_type)[0]
    got = partial if math.isinf(norm_type) else partial ** (1 / norm_type)
    assert expected > 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "optimizer, reference", [(EmbOptimType.EXACT_ADAGRAD, torch.optim.Adagrad), (EmbOptimType.EXACT_SGD, torch.optim.SGD)]
)
def test_the_held_update_is_torchs_update_of_the_clipped_gradient(optimizer, reference):
    dims, ftm = [8, 4], [0, 1, 1]
    emb = _tbe(dims, ftm, optimizer=optimizer)
    tables = [w.detach().clone().requires_grad_() for w in emb.split_embedding_weights()]
    start = [t.detach().clone() for t in tables]
    kwargs = {"lr": 0.1, "eps": 1e-8} if reference is torch.optim.Adagrad else {"lr": 0.1}
    ref_opt = reference(tables, **kwargs)
    head = torch.randn(sum(dims[t] for t in ftm))
    generator = torch.Generator().manual_seed(3)
    batches = [_batch(len(ftm), generator, weighted=True) for _ in range(4)]
    probe = [t.detach().clone().requires_grad_() for t in tables]
    (_reference_lookup(probe, ftm, *batches[0], "sum") * head).sum().backward()
    bound = 0.3 * torch.nn.utils.get_total_norm([t.grad for t in probe]).item()
    clip = apply_gradient_clipping([torch.zeros(1, requires_grad=True)], max_norm=bound)
    HeldBackward(emb, ["t0", "t1"], clip, emb, lambda: None)
    for step, (indices, offsets, weights) in enumerate(batches):
        out = emb(indices=indices, offsets=offsets, per_sample_weights=weights)
        out.register_hook(lambda _g: clip.arm())  # what the sharder's forward hook does
        (out * head).sum().backward()
        ref = _reference_lookup(tables, ftm, indices, offsets, weights, "sum")
        (ref * head).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(tables, bound)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(clip.total_norm, norm, rtol=1e-5, atol=0)
        for ours, theirs in zip(emb.split_embedding_weights(), tables):
            torch.testing.assert_close(ours, theirs.detach(), atol=2e-6, rtol=0, msg=f"step {step}")
    assert norm > bound, "the bound must clip"
    assert min((t.detach() - s).abs().max().item() for t, s in zip(tables, start)) > 1e-3, "the reference must move"
