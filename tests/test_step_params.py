"""step_params (the DDP comm hook's update): one multi-tensor update per virtual group, equal to
torch.optim per parameter."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from overlap_optim import apply_optimizer_in_backward, get_optimizers
from overlap_optim.record import group_of
from overlap_optim.update import StepPlan, step_params
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
    assert len({virtual_key(group_of(p).spec, group_of(p).param_group, p) for p in ours}) == 1
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


@pytest.mark.parametrize("cls, kernel, expected", [
    (torch.optim.Adam, "torch._fused_adam_", [1, 3, 24]),  # torch's fused CPU kernel: one call per setting
    (torch.optim.RMSprop, "torch._foreach_addcdiv_", [1, 1, 1]),  # no fused kernel: one multi-tensor update
    (torch.optim.NAdam, "torch._foreach_sqrt_", [1, 1, 1]),
])
def test_the_cost_of_many_learning_rates(cls, kernel, expected):
    calls = []
    for lrs in ((1e-3,), (1e-3, 3e-4, 1e-4), tuple(1e-3 / (i + 1) for i in range(24))):
        params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(48)]
        for i, lr in enumerate(lrs):
            apply_optimizer_in_backward(cls, params[i :: len(lrs)], {"lr": lr})
        for p in params:
            p.grad = torch.ones_like(p)
        with mock.patch(kernel, wraps=getattr(torch, kernel.removeprefix("torch."))) as update:
            step_params(params)
        calls.append(update.call_count)
    assert calls == expected


def test_other_optimizers_and_user_flags_take_their_own_step():
    asgd, forced = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    apply_optimizer_in_backward(torch.optim.ASGD, [asgd], {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.Adam, [forced], {"lr": 0.1, "foreach": True})
    assert all(virtual_key(group_of(p).spec, group_of(p).param_group, p) is None for p in (asgd, forced))
    for p in (asgd, forced):
        p.grad = torch.ones(2)
    step_params([asgd, forced])
    assert asgd.grad is None and forced.grad is None
    assert not torch.equal(asgd.detach(), torch.ones(2)) and not torch.equal(forced.detach(), torch.ones(2))


TOGETHER = [  # (class, settings, torch's fused kernel that its step() calls on CPU, or None)
    (torch.optim.Adam, {"lr": 0.01, "fused": True}, "torch._fused_adam_"),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "fused": True, "amsgrad": True}, "torch._fused_adamw_"),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}, "torch._fused_sgd_"),
    (torch.optim.Adagrad, {"lr": 0.1, "fused": True}, "torch._fused_adagrad_"),
    (torch.optim.Adam, {"lr": 0.01, "foreach": True}, None),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "foreach": True}, None),
]


@pytest.mark.parametrize("cls, kwargs, kernel", TOGETHER, ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(TOGETHER)])
def test_foreach_and_fused_groups_step_as_torch_optim_steps_their_param_groups(cls, kwargs, kernel):
    """Bitwise against ``cls(..., fused=True)`` (or ``foreach=True``) with one param group per
    annotation, an lr changed by hand after step 1. ``foreach``: one ``step()`` per annotation
    group; ``fused``: the kernel that ``step()`` calls, called here directly, once per setting."""
    ours = _params()
    reference = copy.deepcopy(ours)
    lrs = (kwargs["lr"], kwargs["lr"] / 3, kwargs["lr"] * 2)
    groups = []
    for i, lr in enumerate(lrs):
        apply_optimizer_in_backward(cls, ours[i::3], {**kwargs, "lr": lr})
        groups.append(group_of(ours[i]).param_group)
    ref_opt = cls([{"params": reference[i::3], "lr": lr} for i, lr in enumerate(lrs)], **kwargs)
    start = [q.detach().clone() for q in reference]
    for step in range(4):
        grads = [torch.randn_like(p) for p in ours]
        for p, q, g in zip(ours, reference, grads):
            p.grad, q.grad = g.clone(), g.clone()
        with mock.patch.object(cls, "step", autospec=True, side_effect=cls.step) as steps:
            if kernel is None:
                step_params(ours)
            else:
                with mock.patch(kernel, wraps=getattr(torch, kernel.removeprefix("torch."))) as kernels:
                    step_params(ours)
                assert kernels.call_count == 3  # one per setting
        assert steps.call_count == (3 if kernel is None else 0) and all(p.grad is None for p in ours)
        ref_opt.step()
        if step == 0:
            for mine, theirs in zip(groups, ref_opt.param_groups):
                mine["lr"] = theirs["lr"] = theirs["lr"] * 0.5
        for p, q in zip(ours, reference):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=f"step {step}")
    assert min((q.detach() - s).abs().max().item() for q, s in zip(reference, start)) > 1e-3
    # the state is each tensor's own live optimizer's, as a checkpoint reads it
    live = ours[0]._in_backward_optimizers[0].state[ours[0]]
    assert live and all(torch.equal(live[k], v) for k, v in ref_opt.state[reference[0]].items())


def test_a_fused_group_resumes_from_its_checkpoint_exactly():
    """The stepping optimizer links each tensor's state anew at every step: after
    ``load_state_dict`` replaces those dicts, it steps the loaded state, not the old."""
    ours = torch.nn.ParameterList(_params())
    reference = copy.deepcopy(ours)
    apply_optimizer_in_backward(torch.optim.Adam, list(ours), {"lr": 0.05, "fused": True})
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05, fused=True)
    keyed = get_optimizers(ours)

    def step(batch, models):
        generator = torch.Generator().manual_seed(batch)
        for p, q in zip(ours, reference):
            p.grad = torch.randn(p.shape, generator=generator)
            q.grad = p.grad.clone()
        step_params(list(ours))
        if reference in models:
            ref_opt.step()

    for batch in range(2):
        step(batch, (ours, reference))
    saved, weights = copy.deepcopy(keyed.state_dict()), copy.deepcopy(ours.state_dict())
    step(99, (ours,))  # ours only: the load must undo it
    ours.load_state_dict(weights)
    keyed.load_state_dict(saved)
    for batch in range(2, 4):
        step(batch, (ours, reference))
        for p, q in zip(ours, reference):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=f"batch {batch}")


def test_a_plan_made_once_steps_as_torch_optim_through_lr_changes_and_a_checkpoint_load():
    """A :class:`StepPlan` is made once and stepped again and again, as the DDP hook does per
    bucket: an lr written by hand, and a checkpoint load that replaces every state dict, are
    seen at the next step (the plan keeps no state and no setting)."""
    ours = torch.nn.ParameterList(_params())
    reference = copy.deepcopy(ours)
    lrs = (0.01, 0.003, 0.02)
    for i, lr in enumerate(lrs):
        apply_optimizer_in_backward(torch.optim.Adam, list(ours)[i::3], {"lr": lr, "weight_decay": 0.1})
    ref_opt = torch.optim.Adam([{"params": list(reference)[i::3], "lr": lr} for i, lr in enumerate(lrs)],
                               weight_decay=0.1)
    keyed = get_optimizers(ours)
    plan = StepPlan(list(ours))
    start = [q.detach().clone() for q in reference]

    def step(batch, with_reference=True):
        generator = torch.Generator().manual_seed(batch)
        grads = [torch.randn(p.shape, generator=generator) for p in ours]
        plan.step(grads)
        assert all(p.grad is None for p in ours), "a virtual group needs no .grad"
        if with_reference:
            for q, g in zip(reference, grads):
                q.grad = g
            ref_opt.step()

    for batch in range(2):
        step(batch)
    for mine, theirs in zip(keyed.param_groups, ref_opt.param_groups):
        mine["lr"] = theirs["lr"] = theirs["lr"] * 0.5
    step(2)
    saved, weights = copy.deepcopy(keyed.state_dict()), copy.deepcopy(ours.state_dict())
    step(99, with_reference=False)  # ours only: the load must undo it
    ours.load_state_dict(weights)
    keyed.load_state_dict(saved)
    for batch in range(3, 5):
        step(batch)
        for p, q in zip(ours, reference):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=f"batch {batch}")
    assert min((q.detach() - s).abs().max().item() for q, s in zip(reference, start)) > 1e-3


def test_a_plan_follows_a_parameter_annotated_anew():
    """Annotated anew (``replace=True``) after the plan was made, a parameter steps with its new
    optimizer and settings: the plan is made again."""
    ours = _params(4)
    reference = copy.deepcopy(ours)
    apply_optimizer_in_backward(torch.optim.Adam, ours, {"lr": 0.01})
    ref_opts = [torch.optim.Adam(reference[:2], lr=0.01), torch.optim.Adam(reference[2:], lr=0.01)]
    plan = StepPlan(ours)
    for batch in range(3):
        if batch == 1:
            apply_optimizer_in_backward(torch.optim.SGD, ours[2:], {"lr": 0.3, "momentum": 0.9}, replace=True)
            ref_opts[1] = torch.optim.SGD(reference[2:], lr=0.3, momentum=0.9)
        grads = [torch.randn_like(p) for p in ours]
        plan.step(grads)
        for q, g in zip(reference, grads):
            q.grad = g
        for opt in ref_opts:
            opt.step()
        for p, q in zip(ours, reference):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=f"batch {batch}")


def test_a_fused_group_whose_step_counters_torch_fused_kernel_cannot_take_steps_through_torch_optim():
    """``fused=True`` where a loaded ``step`` counter is float64 (a checkpoint of a float64 run):
    the direct kernel call declines and ``torch.optim``'s own fused step runs, as it would."""
    ours = torch.nn.ParameterList(_params(3))
    reference = copy.deepcopy(ours)
    apply_optimizer_in_backward(torch.optim.Adam, list(ours), {"lr": 0.05, "fused": True})
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.05, fused=True)
    for batch in range(3):
        grads = [torch.randn_like(p) for p in ours]
        for p, q, g in zip(ours, reference, grads):
            p.grad, q.grad = g.clone(), g.clone()
        with mock.patch.object(torch.optim.Adam, "step", autospec=True, side_effect=torch.optim.Adam.step) as steps:
            step_params(list(ours))
        assert steps.call_count == (0 if batch == 0 else 1)
        ref_opt.step()
        if batch == 0:
            for p, q in zip(ours, reference):
                for state in (p._in_backward_optimizers[0].state[p], ref_opt.state[q]):
                    state["step"] = state["step"].double()
        for p, q in zip(ours, reference):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=f"batch {batch}")
