"""step_params (the DDP comm hook's update): one multi-tensor update per virtual group, equal to
torch.optim per parameter."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from overlap_optim import apply_optimizer_in_backward
from overlap_optim.update import step_params
from overlap_optim.virtual_groups import virtual_key

SETTINGS = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.01, "maximize": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "betas": (0.8, 0.9), "eps": 1e-6}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.RMSprop, {"lr": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True, "weight_decay": 0.01}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.01}),
    (torch.optim.Adamax, {"lr": 0.01}),
    (torch.optim.NAdam, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.RAdam, {"lr": 0.01}),
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
    assert len({virtual_key(p._overlap_group.spec, p._overlap_group.param_group, p) for p in ours}) == 1
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


def test_adam_costs_one_update_whatever_the_number_of_learning_rates():
    calls = []
    for lrs in ((1e-3,), (1e-3, 3e-4, 1e-4), tuple(1e-3 / (i + 1) for i in range(24))):
        params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(48)]
        for i, lr in enumerate(lrs):
            apply_optimizer_in_backward(torch.optim.Adam, params[i :: len(lrs)], {"lr": lr})
        for p in params:
            p.grad = torch.ones_like(p)
        with mock.patch("torch._foreach_addcdiv_", wraps=torch._foreach_addcdiv_) as update:
            step_params(params)
        calls.append(update.call_count)
    assert calls == [1, 1, 1]


def test_other_optimizers_and_user_flags_take_their_own_step():
    asgd, forced = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    apply_optimizer_in_backward(torch.optim.ASGD, [asgd], {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.Adam, [forced], {"lr": 0.1, "foreach": True})
    assert all(virtual_key(p._overlap_group.spec, p._overlap_group.param_group, p) is None for p in (asgd, forced))
    for p in (asgd, forced):
        p.grad = torch.ones(2)
    step_params([asgd, forced])
    assert asgd.grad is None and forced.grad is None
    assert not torch.equal(asgd.detach(), torch.ones(2)) and not torch.equal(forced.detach(), torch.ones(2))
