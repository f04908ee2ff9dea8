"""RowOptimizer: the real torch.optim step on touched rows, lazily."""

from __future__ import annotations

import pytest
import torch
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from overlap_optim.spec import AnnotationGroup, describe_optimizer
from overlap_optim.table_optimizer import RowOptimizer

CASES = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.1, "initial_accumulator_value": 0.2, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 0.1, "weight_decay": 0.1, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.1}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    (torch.optim.Adamax, {"lr": 0.1}),
    (torch.optim.NAdam, {"lr": 0.1}),
    (torch.optim.RAdam, {"lr": 0.1}),
    (RowWiseAdagrad, {"lr": 0.1, "weight_decay": 0.1}),
]


def _rows(weight, cls, kwargs) -> RowOptimizer:
    return RowOptimizer(weight, AnnotationGroup(describe_optimizer(cls, kwargs)))


@pytest.mark.parametrize("cls, kwargs", CASES, ids=[c[0].__name__ for c in CASES])
def test_all_rows_touched_equals_dense_torch_optim(cls, kwargs):
    torch.manual_seed(0)
    weight = torch.randn(10, 5)
    reference = weight.clone().requires_grad_()
    start = weight.clone()
    rows, dense = _rows(weight, cls, kwargs), cls([reference], **kwargs)
    for step in range(4):
        grad = torch.randn(10, 5)
        order = torch.randperm(10)  # any order of ids
        rows.step(order, grad[order])
        reference.grad = grad
        dense.step()
        torch.testing.assert_close(weight, reference.detach(), rtol=1e-5, atol=1e-6, msg=f"step {step}")
    assert (reference.detach() - start).abs().min() > 0, "the reference did not move every row"


def test_untouched_rows_and_their_state_do_not_change():
    torch.manual_seed(0)
    weight = torch.randn(8, 3)
    rows = _rows(weight, torch.optim.Adam, {"lr": 0.1, "weight_decay": 0.1})
    rows.step(torch.arange(8), torch.randn(8, 3))
    frozen = torch.tensor([1, 5])
    before_w = weight[frozen].clone()
    before_s = {k: v[frozen].clone() for k, v in rows.row_state.items()}
    touched = torch.tensor([0, 2, 7])
    before_touched = weight[touched].clone()
    rows.step(touched, torch.randn(3, 3))
    assert torch.equal(weight[frozen], before_w)
    assert all(torch.equal(rows.row_state[k][frozen], v) for k, v in before_s.items())
    assert not torch.equal(weight[touched], before_touched)
    assert float(rows.table_state["step"]) == 2.0  # the step counter is per table


def test_touched_rows_follow_torch_optim_on_just_those_rows():
    """A row first touched late starts from fresh state, as its own torch.optim would."""
    torch.manual_seed(0)
    weight = torch.randn(4, 3)
    late = weight[3:].clone().requires_grad_()
    rows = _rows(weight, torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.3})
    rows.step(torch.tensor([0, 1]), torch.randn(2, 3))
    grad = torch.randn(1, 3)
    rows.step(torch.tensor([3]), grad)
    reference = torch.optim.Adagrad([late], lr=0.1, initial_accumulator_value=0.3)
    late.grad = grad
    reference.step()
    torch.testing.assert_close(weight[3:], late.detach())
