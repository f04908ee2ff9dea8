"""step_params: one fused/foreach update per compatible set, equal to torch.optim per parameter."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from overlap_optim import apply_optimizer_in_backward
from overlap_optim.update import fused_key, step_params

SETTINGS = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.01, "maximize": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "betas": (0.8, 0.9), "eps": 1e-6}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.RMSprop, {"lr": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True, "weight_decay": 0.01}),
]


def _params(n: int = 6) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3 + i % 3, 4)) for i in range(n)]


@pytest.mark.parametrize("cls, kwargs", SETTINGS, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(SETTINGS)])
def test_equals_torch_optim_with_three_learning_rates(cls, kwargs):
    ours = _params()
    reference = copy.deepcopy(ours)
    lrs = (kwargs["lr"], kwargs["lr"] / 3, kwargs["lr"] * 2)
    ref_opts = []
    for i, lr in enumerate(lrs):
        apply_optimizer_in_backward(cls, ours[i::3], {**kwargs, "lr": lr})
        ref_opts.append(cls(reference[i::3], **{**kwargs, "lr": lr}))
    assert len({fused_key(p) for p in ours}) == 1  # floats differ, one set
    for step in range(4):
        grads = [torch.randn_like(p) for p in ours]
        for p, q, g in zip(ours, reference, grads):
            p.grad, q.grad = g.clone(), g.clone()
        step_params(ours)
        for opt in ref_opts:
            opt.step()
        assert all(p.grad is None for p in ours)
        for p, q in zip(ours, reference):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=f"step {step}")


def test_adam_costs_one_fused_call_per_distinct_float_setting_not_per_parameter():
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(300)]
    for i, lr in enumerate((1e-3, 3e-4, 1e-4)):
        apply_optimizer_in_backward(torch.optim.Adam, params[i::3], {"lr": lr})
    for p in params:
        p.grad = torch.ones_like(p)
    with mock.patch("torch._fused_adam_", wraps=torch._fused_adam_) as fused:
        step_params(params)
    assert fused.call_count == 3


def test_other_optimizers_and_user_flags_take_their_own_step():
    adagrad, forced = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    apply_optimizer_in_backward(torch.optim.Adagrad, [adagrad], {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.Adam, [forced], {"lr": 0.1, "foreach": True})
    assert fused_key(adagrad) is None and fused_key(forced) is None
    for p in (adagrad, forced):
        p.grad = torch.ones(2)
    step_params([adagrad, forced])
    assert adagrad.grad is None and forced.grad is None
    assert not torch.equal(adagrad.detach(), torch.ones(2)) and not torch.equal(forced.detach(), torch.ones(2))
