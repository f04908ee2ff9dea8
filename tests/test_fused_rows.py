"""A fused table's backward in our compiled pass (``sharders.fused_rows``), in one process, on
FBGEMM's TBE itself (FBGEMM runs the lookup).

Each step is checked against ``torch.optim`` (torchrec's ``RowWiseAdagrad`` for the row-wise
kind) on copies of the tables, after every step: duplicate ids, per-sample weights, mean and no
pooling, tables of different widths, a table read by two features, rows no batch touches. Clipped
by norm: ``total_norm`` against ``clip_grad_norm_``'s, then the update of the clipped gradient.
The pass is deterministic: the same bits at 1 and 2 threads. The 2-rank cases run through the
sharder (``test_clipping_sharded``, ``test_sharder_parity``, the promise matrix, each with and
without the extension).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from overlap_optim import apply_gradient_clipping
from sharders import fused_rows
from sharders.fused_backward import HeldBackward
from sharders.fused_rows import CompiledBackward
from _precision_bodies import ulps
from test_fused_clipping import BATCH, CASES, _batch, _reference_lookup, _tbe

pytestmark = pytest.mark.skipif(not fused_rows.applies(EmbOptimType.EXACT_SGD, "cpu"),
                                reason="the compiled extension is not built here (no C++ compiler at install)")

OPTIMIZERS = {
    "sgd": (EmbOptimType.EXACT_SGD, torch.optim.SGD, {"lr": 0.1}),
    "adagrad": (EmbOptimType.EXACT_ADAGRAD, torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}),
    "rowwise_adagrad": (EmbOptimType.EXACT_ROWWISE_ADAGRAD, RowWiseAdagrad, {"lr": 0.1, "eps": 1e-8}),
}
LOOKUPS = {**CASES, "unpooled_shared_table": ([8, 8], [0, 1, 1], PoolingMode.NONE, False)}


def _lookup(tables, ftm, indices, offsets, weights, pooling):
    """torch's lookup, laid out as the TBE's output: pooled bags side by side, or one row per id."""
    if pooling != PoolingMode.NONE:
        mode = "mean" if pooling == PoolingMode.MEAN else "sum"
        return _reference_lookup(tables, ftm, indices, offsets, weights, mode)
    return torch.cat([F.embedding(indices[int(offsets[f * BATCH]) : int(offsets[(f + 1) * BATCH])], tables[t])
                      for f, t in enumerate(ftm)])


def _setup(optimizer, lookup, seed=3, steps=4, precision=SparseType.FP32):
    dims, ftm, pooling, weighted = LOOKUPS[lookup]
    weighted = weighted and pooling == PoolingMode.SUM  # torch's embedding_bag weighs sum pooling only
    kind, reference, kwargs = OPTIMIZERS[optimizer]
    emb = _tbe(dims, ftm, pooling, optimizer=kind, precision=precision)
    if kind == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        emb.update_hyper_parameters({"eps": 1e-8})
    tables = [w.detach().float().requires_grad_() for w in emb.split_embedding_weights()]
    generator = torch.Generator().manual_seed(seed)
    batches = [_batch(len(ftm), generator, weighted) for _ in range(steps)]
    return emb, tables, reference(tables, **kwargs), ftm, pooling, batches


def _train(emb, tables, ref_opt, ftm, pooling, batches, norm_type=None, compiled=True):
    """Ours (FBGEMM's lookup, our backward) against the reference, compared after every step;
    with ``norm_type``, both clip by that norm at 0.3x the first step's. FP16 tables: the
    reference steps a float32 copy of its FP16 weights, re-read every step, and rounds the result
    once (docs/precision.md); returns the worst ulps of each step. ``compiled=False``: FBGEMM's
    own backward instead of ours."""
    start = [t.detach().clone() for t in tables]
    stored = [w.detach().clone() for w in emb.split_embedding_weights()]
    low = stored[0].dtype != torch.float32
    worst = []
    width = emb(indices=batches[0][0], offsets=batches[0][1], per_sample_weights=batches[0][2]).shape[1]
    head = torch.randn(width, generator=torch.Generator().manual_seed(11))
    clip, bound = None, None
    if norm_type is not None:
        probe = [t.detach().clone().requires_grad_() for t in tables]
        (_lookup(probe, ftm, *batches[0], pooling) * head).sum().backward()
        bound = 0.3 * torch.nn.utils.get_total_norm([t.grad for t in probe], norm_type).item()
        clip = apply_gradient_clipping([torch.zeros(1, requires_grad=True)], max_norm=bound, norm_type=norm_type)
    HeldBackward(emb, ["t"], clip, emb, lambda: None, CompiledBackward(emb) if compiled else None)
    for step, (indices, offsets, weights) in enumerate(batches):
        for table, weight in zip(tables, stored):
            table.data = weight.float()  # the reference re-reads its stored weights
        out = emb(indices=indices, offsets=offsets, per_sample_weights=weights)
        if clip is not None:
            out.register_hook(lambda _g: clip.arm())  # what the sharder's forward hook does
        (out * head).sum().backward()
        (_lookup(tables, ftm, indices, offsets, weights, pooling) * head).sum().backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(tables, bound, norm_type)
            torch.testing.assert_close(clip.total_norm, norm, rtol=1e-5, atol=0, msg=f"step {step}")
            assert step > 0 or norm > bound, "the bound must clip"
        ref_opt.step()
        ref_opt.zero_grad()
        stored = [t.detach().to(w.dtype) for t, w in zip(tables, stored)]  # the one rounding (FP16)
        if low:
            worst.append(max(ulps(ours, theirs) for ours, theirs in zip(emb.split_embedding_weights(), stored)))
            continue
        for ours, theirs in zip(emb.split_embedding_weights(), tables):
            torch.testing.assert_close(ours, theirs.detach(), atol=2e-6, rtol=0, msg=f"step {step}")
    assert min((t.detach() - s).abs().max().item() for t, s in zip(tables, start)) > 1e-3, "the reference must move"
    return worst


@pytest.mark.parametrize("lookup", list(LOOKUPS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_each_step_is_torchs_update(optimizer, lookup):
    _train(*_setup(optimizer, lookup))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("lookup", ["weighted_shared_table", "mean_pooling", "mixed_widths", "unpooled_shared_table"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_clipped_by_norm_the_norm_and_the_update_are_torchs(optimizer, lookup, norm_type):
    _train(*_setup(optimizer, lookup), norm_type=norm_type)


@pytest.mark.parametrize("norm_type", [None, 2.0])
@pytest.mark.parametrize("lookup", ["mixed_widths", "weighted_shared_table", "mean_pooling", "unpooled_shared_table"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_fp16_tables_step_in_float32_rounded_once(optimizer, lookup, norm_type):
    # measured: 0 ulps at every step in every case (the float32 arithmetic is the reference's)
    worst = _train(*_setup(optimizer, lookup, precision=SparseType.FP16), norm_type=norm_type)
    assert max(worst) == 0, worst


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_fbgemms_own_fp16_backward_fails_that_reference(optimizer):
    """What the FP16 tables would get from FBGEMM's CPU backward (it rounds the update to FP16
    before adding it: two roundings a step) is caught by the same check."""
    worst = _train(*_setup(optimizer, "mixed_widths", precision=SparseType.FP16), compiled=False)
    assert max(worst) > 1, worst


def _big_lookup(seed):
    """Enough ids and rows for many chunks of the pass (64 rows each), rows named many times."""
    generator = torch.Generator().manual_seed(seed)
    features, batch = 3, 400
    lengths = torch.randint(0, 12, (features * batch,), generator=generator)
    count = int(lengths.sum())
    indices = (torch.rand(count, generator=generator).pow(3) * 3000).long()
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    weights = torch.rand(count, generator=generator)
    grad = torch.randn(batch, 8 + 16 + 16, generator=generator)
    return (indices, offsets, weights), grad


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_the_same_bits_at_one_and_two_threads(optimizer):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    specs = [(3000, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for dim in (8, 16)]
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 1, 2):
            torch.set_num_threads(count)
            torch.manual_seed(0)
            emb = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=OPTIMIZERS[optimizer][0], learning_rate=0.1,
                                                        feature_table_map=[0, 1, 1])
            rows = CompiledBackward(emb)
            partials = []
            for seed in range(3):
                lookup, grad = _big_lookup(seed)
                if seed == 1:  # clipped: both halves
                    partials.append(rows.partial_norm(lookup, grad, 2.0))
                    rows.step(lookup, grad, torch.tensor(0.5))
                else:
                    rows.step(lookup, grad, None)
            results.append(([w.clone() for w in emb.split_embedding_weights()], partials))
    finally:
        torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads
    first_weights, first_partials = results[0]
    for weights, partials in results[1:]:
        for a, b in zip(first_weights, weights):
            assert torch.equal(a, b)
        assert torch.equal(first_partials[0], partials[0])
    assert first_partials[0].item() > 0


def test_an_id_out_of_range_is_refused_with_nothing_changed():
    emb = _tbe([8], [0], optimizer=EmbOptimType.EXACT_ADAGRAD)
    before = [t.clone() for t in (*emb.split_embedding_weights(), emb.split_optimizer_states()[0][0])]
    offsets = torch.tensor([0, 2, 3, 3, 3, 4])
    indices = torch.tensor([1, 2, 2, 30])  # the table has 30 rows
    with pytest.raises(RuntimeError, match="id 30 out of range for table 0's 30 rows"):
        CompiledBackward(emb).step((indices, offsets, None), torch.ones(BATCH, 8), None)
    after = (*emb.split_embedding_weights(), emb.split_optimizer_states()[0][0])
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_which_backward_runs_depends_on_the_configuration_only(monkeypatch):
    assert all(fused_rows.applies(kind, "cpu") for kind, _, _ in OPTIMIZERS.values())
    assert not fused_rows.applies(EmbOptimType.EXACT_SGD, "cuda")  # FBGEMM's own backward there
    assert not fused_rows.applies(EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD, "cpu")
    monkeypatch.setattr(fused_rows, "_STEP", None)  # as where the extension was not built
    assert not fused_rows.applies(EmbOptimType.EXACT_SGD, "cpu")


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_gradient_sliced_from_a_wider_one_is_read_in_place(optimizer):
    """A kernel's output gradient is often columns of the lookup's wider one: read as it lies."""
    copies = []
    for sliced in (False, True):
        emb, *_ = _setup(optimizer, "mixed_widths")
        torch.manual_seed(1)
        lookup = _batch(4, torch.Generator().manual_seed(2), True)
        wide = torch.randn(BATCH, 100)
        columns = wide[:, 10 : 10 + int(emb.D_offsets[-1])]
        grad = columns if sliced else columns.contiguous()
        assert grad.is_contiguous() != sliced
        CompiledBackward(emb).step(lookup, grad, None)
        copies.append(emb.split_embedding_weights())
    for a, b in zip(*copies):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_lookup_with_no_ids_changes_nothing(optimizer):
    """A rank whose row shard no id of the batch reached: nothing steps, the partial norm is 0."""
    emb, *_ = _setup(optimizer, "weighted_shared_table")
    before = [w.clone() for w in emb.split_embedding_weights()]
    lookup = (torch.zeros(0, dtype=torch.long), torch.zeros(3 * BATCH + 1, dtype=torch.long), None)
    grad = torch.randn(BATCH, int(emb.D_offsets[-1]))
    rows = CompiledBackward(emb)
    rows.step(lookup, grad, None)
    assert rows.partial_norm(lookup, grad, 2.0).item() == 0.0
    rows.step(lookup, grad, torch.tensor(0.5))
    assert all(torch.equal(a, b) for a, b in zip(before, emb.split_embedding_weights()))
