"""Gradient accumulation (``overlap_optim.no_step``) in one process, against a plain torch loop:
k backward() calls, then one torch.optim step (and ``clip_grad_norm_`` on the summed gradient).

Every test compares the weights after every window with the reference, and checks that the
reference moved. The rule for undeclared accumulation is checked by its error, and a loop that
follows it (step() after every backward) by its weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import overlap_optim
from overlap_optim import apply_gradient_clipping, apply_optimizer_in_backward, get_optimizers, no_step


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _windows(k, windows=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [[(torch.randn(5, 6, generator=generator), torch.randn(5, 1, generator=generator)) for _ in range(k)]
            for _ in range(windows)]


def _loss(model, batch, k):
    x, y = batch
    return (model(x) - y).pow(2).mean() / k


def _reference_window(reference, optimizers, window, k, max_norm=None):
    for batch in window:
        _loss(reference, batch, k).backward()
    norm = None if max_norm is None else torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
    return norm


def _compare(model, reference, where):
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0, msg=lambda m: f"{where}, {name}: {m}")


@pytest.mark.parametrize("k", [2, 3])
def test_micro_batches_step_once_on_their_summed_gradient(k):
    model = _model()
    reference = copy.deepcopy(model)
    apply_optimizer_in_backward(torch.optim.Adam, model[0].parameters(), {"lr": 0.05})
    apply_optimizer_in_backward(torch.optim.SGD, model[2].parameters(), {"lr": 0.1, "momentum": 0.9})
    ref_opts = [torch.optim.Adam(reference[0].parameters(), lr=0.05),
                torch.optim.SGD(reference[2].parameters(), lr=0.1, momentum=0.9)]
    opt = get_optimizers(model)
    start = copy.deepcopy(reference)
    for w, window in enumerate(_windows(k)):
        for batch in window[:-1]:
            with no_step(model):
                _loss(model, batch, k).backward()
            assert all(p.grad is not None for p in model.parameters()), "the gradient accumulates"
        _loss(model, window[-1], k).backward()
        opt.step()
        assert all(p.grad is None for p in model.parameters()), "released after the update"
        _reference_window(reference, ref_opts, window, k)
        _compare(model, reference, f"window {w}")
    assert min((a - b).abs().max().item() for a, b in zip(reference.parameters(), start.parameters())) > 1e-3


def test_clipping_applies_to_the_summed_gradient():
    k = 3
    model = _model()
    reference = copy.deepcopy(model)
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.05})
    windows = _windows(k)
    probe = copy.deepcopy(reference)
    for batch in windows[0]:
        _loss(probe, batch, k).backward()
    bound = 0.3 * torch.nn.utils.get_total_norm([p.grad for p in probe.parameters()]).item()
    clip = apply_gradient_clipping(model.parameters(), max_norm=bound)
    ref_opts = [torch.optim.Adam(reference.parameters(), lr=0.05)]
    for w, window in enumerate(windows):
        for batch in window[:-1]:
            with no_step(model):
                _loss(model, batch, k).backward()
        _loss(model, window[-1], k).backward()
        norm = _reference_window(reference, ref_opts, window, k, max_norm=bound)
        assert norm > bound, "the bound must clip"
        torch.testing.assert_close(clip.total_norm, norm, rtol=1e-5, atol=0)
        _compare(model, reference, f"window {w}")


def test_an_update_inside_no_step_is_caught(monkeypatch):
    """Mutation: the per-parameter hook ignores no_step; the same comparison must fail."""
    from overlap_optim import update

    monkeypatch.setattr(update, "window_of_params", lambda *params: None)
    with pytest.raises(AssertionError):
        test_micro_batches_step_once_on_their_summed_gradient(2)


def test_undeclared_accumulation_raises_in_the_second_window():
    model = _model()
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.05})
    opt = get_optimizers(model)
    window = _windows(2, windows=1)[0]
    for batch in window:  # the first window: step() was never called yet, nothing to check
        _loss(model, batch, 2).backward()
    opt.step()
    _loss(model, window[0], 2).backward()
    with pytest.raises(RuntimeError, match=r"no step\(\).*overlap_optim.no_step\(model\)"):
        _loss(model, window[1], 2).backward()


def test_a_loop_that_never_steps_or_steps_every_time_is_not_checked():
    model = _model()
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.05})
    opt = get_optimizers(model)
    batch = _windows(1, windows=1)[0][0]
    for _ in range(3):
        _loss(model, batch, 1).backward()  # step() is optional
    for _ in range(3):
        _loss(model, batch, 1).backward()
        opt.step()
    with no_step(model):  # declared micro-batches never count
        _loss(model, batch, 1).backward()
    _loss(model, batch, 1).backward()


def test_refusals_name_the_problem():
    plain = _model()
    with pytest.raises(ValueError, match="nothing in this model is annotated"):
        with no_step(plain):
            pass
    with pytest.raises(TypeError, match="takes an nn.Module"):
        with no_step("model"):
            pass
    model = _model()
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    with no_step(model):
        with pytest.raises(RuntimeError, match="already inside no_step"):
            with no_step(model):
                pass


def test_a_checkpoint_inside_a_window_is_refused_and_after_it_works():
    model = _model()
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.05})
    opt = get_optimizers(model)
    window = _windows(2, windows=1)[0]
    with no_step(model):
        _loss(model, window[0], 2).backward()
    with pytest.raises(RuntimeError, match=r"state_dict\(\) inside a no_step window"):
        opt.state_dict()
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) inside a no_step window"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    _loss(model, window[1], 2).backward()
    saved = opt.state_dict()
    assert saved["state"], "the window's update made state"
    opt.load_state_dict(saved)


def test_no_step_does_not_document_refusals_it_no_longer_makes():
    """Fused, fallback and cross-shard tables accumulate exactly (tests/test_accumulation_distributed.py
    and the promise matrix's ``micro``): no_step's docs must not say they are refused (they did on the
    main of 2026-11-27), nor list an error that nothing in no_step raises."""
    import inspect

    import overlap_optim.accumulation as accumulation

    assert "NotImplementedError" not in no_step.__doc__ and "NotImplementedError" not in inspect.getsource(no_step)
    assert "Not covered yet" not in accumulation.__doc__
    assert "fused, fallback" in accumulation.__doc__  # what it says instead


class _Pipeline:
    """The least a TorchRec train pipeline does per batch: forward, backward, its optimizer's step."""

    def __init__(self, model, optimizer):
        self._model, self._optimizer = model, optimizer

    def progress(self, batches):
        self._optimizer.zero_grad()
        self._model(next(batches)).sum().backward()
        self._optimizer.step()


def test_torchrecs_accumulation_wrapper_steps_once_per_window_and_an_unfinished_window_is_refused():
    """One process, TorchRec's GradientAccumulationWrapper (num_steps=3) around a minimal pipeline, no
    no_step: equal to torch.optim on each window's summed gradient. A forward outside the wrapper while
    its window is unfinished raises instead of holding its backward too."""
    from torchrec.distributed.train_pipeline.gradient_accumulation import (
        GradientAccumulationConfig, GradientAccumulationWrapper,
    )

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.05})
    keyed = get_optimizers(model)
    wrapper = GradientAccumulationWrapper(_Pipeline(model, keyed), keyed, model, GradientAccumulationConfig(num_steps=3))
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    start = reference.weight.detach().clone()
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    batches = iter(xs)
    for window in range(2):
        for _ in range(3):
            wrapper.progress(batches)
        for x in xs[3 * window : 3 * window + 3]:
            reference(x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(model.weight.detach(), reference.weight.detach(), atol=1e-7, rtol=0)
    assert (reference.weight.detach() - start).abs().max().item() > 1e-2, "the reference must move"
    wrapper.progress(batches)  # a window opens
    before = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="GradientAccumulationWrapper opened is unfinished"):
        model(xs[7]).sum().backward()
    assert torch.equal(model.weight.detach(), before)
