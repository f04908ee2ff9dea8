"""The optimizer model: one probed description per annotation, for torch's and third-party optimizers."""

from __future__ import annotations

import pytest
import torch
from came_pytorch import CAME
from pytorch_optimizer import LARS, Lamb
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from overlap_optim import apply_optimizer_in_backward, describe_optimizer


@pytest.mark.parametrize("cls, kwargs, rows, columns", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.3}, True, True),
    (torch.optim.Adam, {"lr": 0.1, "amsgrad": True}, True, True),
    (torch.optim.ASGD, {"lr": 0.1}, True, True),
    (torch.optim.Rprop, {"lr": 0.1}, True, True),
    (torch.optim.NAdam, {"lr": 0.1, "decoupled_weight_decay": True}, True, True),
    (RowWiseAdagrad, {"lr": 0.1}, True, False),  # one accumulator per whole row
    (torch.optim.Adafactor, {"lr": 0.1}, False, False),  # factored moments of the whole matrix
    (torch.optim.Muon, {"lr": 0.1}, False, False),  # orthogonalises the whole matrix
    (CAME, {"lr": 0.1}, False, False),
])
def test_separability_is_measured_not_listed(cls, kwargs, rows, columns):
    spec = describe_optimizer(cls, kwargs)
    assert (spec.row_separable, spec.column_separable) == (rows, columns)


def test_a_made_up_optimizer_that_normalises_by_the_whole_tensor_is_not_separable():
    class WholeNorm(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad / p.grad.norm(), alpha=-group["lr"])

    spec = describe_optimizer(WholeNorm, {})
    assert not spec.row_separable and not spec.column_separable


def test_state_layout_names_each_entry():
    layout = {n: e.layout for n, e in describe_optimizer(torch.optim.Adafactor, {}).state.items()}
    assert layout == {"step": "scalar", "row_var": "row", "col_var": "column"}
    layout = {n: (e.layout, e.fresh) for n, e in describe_optimizer(torch.optim.Adagrad, {"initial_accumulator_value": 0.3}).state.items()}
    assert layout == {"step": ("scalar", layout["step"][1]), "sum": ("element", pytest.approx(0.3))}
    assert describe_optimizer(RowWiseAdagrad, {}).state["sum"].tail == (1,)


def test_float_settings_may_move_and_the_rest_are_fixed():
    spec = describe_optimizer(torch.optim.Adam, {"lr": 0.1})
    assert spec.float_keys == {"lr", "betas", "eps", "weight_decay"}
    assert {"amsgrad", "maximize", "foreach"} <= set(spec.fixed)
    assert describe_optimizer(torch.optim.Adam, {"lr": 0.5}).share_key == spec.share_key
    assert describe_optimizer(torch.optim.Adam, {"amsgrad": True}).share_key != spec.share_key
    with pytest.raises(ValueError, match=r"where: Adam's setting amsgrad=True was changed at run time"):
        spec.check_live({**spec.defaults, "amsgrad": True}, "where")
    spec.check_live({**spec.defaults, "lr": 3.0, "betas": (0.5, 0.5)}, "where")  # floats may move


@pytest.mark.parametrize("cls", [Lamb, LARS])
def test_state_kept_in_the_param_group_is_modelled_as_per_tensor_scalar_state(cls):
    spec = describe_optimizer(cls, {"lr": 0.1})
    assert spec.group_state == ("step",)
    assert spec.state["step"].layout == "scalar"  # kept per tensor, checkpointed with the rest
    assert not spec.row_separable and not spec.column_separable  # a trust ratio reads the whole tensor


def test_a_name_kept_both_in_the_group_and_per_parameter_is_refused():
    class Both(torch.optim.SGD):
        def step(self, closure=None):
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1
                for p in group["params"]:
                    self.state[p]["step"] = group["step"]
            return super().step(closure)

    with pytest.raises(NotImplementedError, match=r"Both keeps \['step'\] both in its param group and per parameter"):
        describe_optimizer(Both, {"lr": 0.1})


def test_an_update_that_reads_cosines_is_found_not_separable():
    """AdamP projects its update when the gradient is nearly orthogonal to the weight (per row, or
    over the whole weight): random probe gradients alone never take that branch, so it passed as
    separable and ran silently wrong on column shards (3e-3 after 3 steps). The probe now also
    starts from gradients orthogonal to the weight's rows, columns and whole."""
    from pytorch_optimizer import AdamP, Lion

    adamp = describe_optimizer(AdamP, {"lr": 0.05})
    assert not adamp.row_separable and not adamp.column_separable
    lion = describe_optimizer(Lion, {"lr": 0.01})  # elementwise: still separable both ways
    assert lion.row_separable and lion.column_separable
