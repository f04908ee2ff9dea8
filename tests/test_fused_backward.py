"""FBGEMM's backward held back (``sharders.fused_backward``), on FBGEMM's TBE itself, in one process;
the same with our compiled backward (``sharders.fused_rows``) in its place.

A window of micro-batches (the ``no_step`` window open for all but the last) must equal one
``torch.optim`` step on the summed gradient of copies of the tables, rows touched by several
micro-batches and by none included; with clipping, ``clip_grad_norm_`` of that sum first. The
weights are compared after every window; the reference must move. The 2-rank cases, through the
sharder, are in ``test_accumulation_distributed``.
"""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from overlap_optim import apply_gradient_clipping
from sharders import fused_rows
from sharders.fused_backward import HeldBackward
from overlap_optim.accumulation import window_of
from test_fused_clipping import _batch, _reference_lookup, _tbe


@pytest.mark.parametrize("backward", ["fbgemm", "compiled"])
@pytest.mark.parametrize("clipped", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_a_window_is_one_update_on_the_summed_gradient(k, clipped, backward):
    dims, ftm = [8, 4], [0, 1, 1]
    emb = _tbe(dims, ftm, optimizer=EmbOptimType.EXACT_ADAGRAD)
    tables = [w.detach().clone().requires_grad_() for w in emb.split_embedding_weights()]
    start = [t.detach().clone() for t in tables]
    ref_opt = torch.optim.Adagrad(tables, lr=0.1, eps=1e-8)
    head = torch.randn(sum(dims[t] for t in ftm))
    generator = torch.Generator().manual_seed(5)
    windows = [[_batch(len(ftm), generator, weighted=True) for _ in range(k)] for _ in range(3)]
    bound, clip = None, None
    if clipped:
        probe = [t.detach().clone().requires_grad_() for t in tables]
        for micro in windows[0]:
            (_reference_lookup(probe, ftm, *micro, "sum") * head).sum().backward()
        bound = 0.3 * torch.nn.utils.get_total_norm([t.grad for t in probe]).item()
        clip = apply_gradient_clipping([torch.zeros(1, requires_grad=True)], max_norm=bound)
    held, updates = window_of(emb), []  # the TBE stands for the sharded module that owns it
    if backward == "compiled" and not fused_rows.applies(EmbOptimType.EXACT_ADAGRAD, "cpu"):
        pytest.skip("the compiled extension is not built here (no C++ compiler at install)")
    compiled = fused_rows.CompiledBackward(emb) if backward == "compiled" else None
    HeldBackward(emb, ["t0", "t1"], clip, emb, lambda: updates.append(1), compiled)
    for w, window in enumerate(windows):
        for m, (indices, offsets, weights) in enumerate(window):
            held.open = m < k - 1
            out = emb(indices=indices, offsets=offsets, per_sample_weights=weights)
            if clip is not None and not held.open:
                out.register_hook(lambda _g: clip.arm())  # what the sharder's forward hook does
            (out * head).sum().backward()
            (_reference_lookup(tables, ftm, indices, offsets, weights, "sum") * head).sum().backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(tables, bound)
            torch.testing.assert_close(clip.total_norm, norm, rtol=1e-5, atol=0)
            assert norm > bound, "the bound must clip"
        ref_opt.step()
        ref_opt.zero_grad()
        assert len(updates) == w + 1, "one update per window"
        for ours, theirs in zip(emb.split_embedding_weights(), tables):
            torch.testing.assert_close(ours, theirs.detach(), atol=2e-6, rtol=0, msg=f"window {w}")
    assert min((t.detach() - s).abs().max().item() for t, s in zip(tables, start)) > 1e-3, "the reference must move"
