"""apply_optimizer_in_backward: metadata, refusals, meta-device models, interop."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.optim.apply_optimizer_in_backward import _get_in_backward_optimizers
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import overlap_optim
from _models import TinyModel, assert_same_params, loss_of, make_batch
from overlap_optim import apply_optimizer_in_backward, get_optimizers, materialize
from overlap_optim.annotation import carry_over
from overlap_optim.record import record_of

_ATTRS = ("_optimizer_classes", "_optimizer_kwargs", "_in_backward_optimizers")


def _bare(params) -> bool:
    return all(not hasattr(p, a) and record_of(p) is None for p in params for a in _ATTRS)


def _train_against(model, reference, ref_opts, steps: int = 3, before_step=lambda: None) -> None:
    """Three steps of the annotated model and of the reference with its optimizers (``before_step``
    runs between the reference's backward and its step), compared."""
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        batch = make_batch(generator)
        loss_of(model, batch).backward()
        loss_of(reference, batch).backward()
        before_step()
        for o in ref_opts:
            o.step()
            o.zero_grad()
        assert_same_params(model, reference, step)


def test_records_the_metadata_torch_and_torchrec_read():
    model = TinyModel()
    table = model.ebc.embedding_bags["t0"].weight
    apply_optimizer_in_backward(torch.optim.Adagrad, [table], {"lr": 0.05})
    assert table._optimizer_classes == [torch.optim.Adagrad]
    assert table._optimizer_kwargs == [{"lr": 0.05}]
    (live,) = table._in_backward_optimizers
    assert isinstance(live, torch.optim.Adagrad) and live.param_groups[0]["params"] == [table]
    assert _get_in_backward_optimizers(model) == [live]
    names = [n for n, _ in in_backward_optimizer_filter(model.named_parameters(), include=True)]
    assert names == ["ebc.embedding_bags.t0.weight"]


def test_grad_is_released_and_weight_updated_in_backward():
    lin = torch.nn.Linear(2, 2)
    before = lin.weight.detach().clone()
    apply_optimizer_in_backward(torch.optim.SGD, lin.parameters(), {"lr": 1.0})
    lin(torch.ones(1, 2)).sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is None
    assert not torch.equal(lin.weight.detach(), before)


@pytest.mark.parametrize(
    "cls, kwargs, err, match",
    [
        (torch.nn.Linear, {}, TypeError, "must be a torch.optim.Optimizer subclass, got <class 'torch.nn"),
        ("Adam", {}, TypeError, "must be a torch.optim.Optimizer subclass, got 'Adam'"),
        (torch.optim.Adam, {"momentum": 0.9}, TypeError,
         r"Adam does not take the kwarg\(s\) \['momentum'\]; it accepts \['lr', 'betas'"),
        (RowWiseAdagrad, {"betas": (0.9, 0.9)}, TypeError,
         r"RowWiseAdagrad does not take the kwarg\(s\) \['betas'\]; it accepts \['lr', 'lr_decay'"),
        (torch.optim.SGD, {"lr": -1.0}, ValueError, "rejected a value: Invalid learning rate: -1.0"),
        (torch.optim.Adam, {"betas": (1.5, 0.9)}, ValueError, "Invalid beta parameter at index 0: 1.5"),
        (torch.optim.Adam, {"betas": (0.9,)}, ValueError, r"rejected a value: its constructor failed with IndexError"),
        (torch.optim.LBFGS, {}, ValueError, "LBFGS cannot run per parameter in backward: its step.. needs a closure"),
        (torch.optim.SparseAdam, {}, ValueError, "SparseAdam.* cannot step a 2-d .*dense gradients"),
    ],
    ids=["module-class", "string", "adam-momentum", "rowwise-swallowed-kwarg", "negative-lr",
         "betas", "betas-too-short", "lbfgs", "sparse-adam"],
)
def test_bad_optimizer_is_refused_and_nothing_changes(cls, kwargs, err, match):
    model = TinyModel()
    with pytest.raises(err, match=match):
        apply_optimizer_in_backward(cls, model.ebc.parameters(), kwargs)
    assert _bare(model.parameters())


def test_bad_params_are_refused():
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    live = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="params is empty"):
        apply_optimizer_in_backward(torch.optim.SGD, iter([]), {"lr": 0.1})
    with pytest.raises(ValueError, match=r"params\[1\] \(shape \(3,\)\) does not require grad"):
        apply_optimizer_in_backward(torch.optim.SGD, [live, frozen], {"lr": 0.1})
    with pytest.raises(TypeError, match=r"params\[0\] is a str, not a tensor"):
        apply_optimizer_in_backward(torch.optim.SGD, ["w"], {"lr": 0.1})
    assert _bare([live, frozen])


def test_a_non_leaf_tensor_is_refused_before_any_parameter_is_annotated():
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"params\[1\] \(shape \(2, 2\)\) is not a leaf tensor .*MulBackward0"):
        apply_optimizer_in_backward(torch.optim.SGD, [lin.bias, lin.weight * 2], {"lr": 0.1})
    assert _bare(lin.parameters())  # the bias before it was left alone: the corrected call goes through
    apply_optimizer_in_backward(torch.optim.SGD, [lin.bias, lin.weight], {"lr": 0.1})
    lin(torch.ones(1, 2)).sum().backward()
    assert lin.bias.grad is None and lin.weight.grad is None


def test_second_annotation_is_refused_unless_replace():
    model = TinyModel()
    reference = copy.deepcopy(model)
    dense = list(model.dense.parameters())
    apply_optimizer_in_backward(torch.optim.SGD, dense, {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.SGD, dense, {"lr": 0.1})  # the same: fine
    with pytest.raises(ValueError, match=r"already annotated with SGD\(\{'lr': 0.1\}\).*replace=True"):
        apply_optimizer_in_backward(torch.optim.Adam, dense, {"lr": 0.01})
    assert dense[0]._optimizer_classes == [torch.optim.SGD]

    apply_optimizer_in_backward(torch.optim.Adam, dense, {"lr": 0.01}, replace=True)
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.1})
    ref_opts = [torch.optim.Adam(reference.dense.parameters(), lr=0.01),
                torch.optim.SGD(reference.ebc.parameters(), lr=0.1)]
    _train_against(model, reference, ref_opts)
    assert len(get_optimizers(model).param_groups) == 2  # the replaced group is empty and gone


def test_meta_parameters_record_metadata_only_then_materialize():
    reference = TinyModel()
    model = TinyModel(device="meta")
    apply_optimizer_in_backward(torch.optim.Adam, model.dense.parameters(), {"lr": 0.01})
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.1})
    weight = model.dense[0].weight
    assert weight.is_meta and weight._optimizer_classes == [torch.optim.Adam]
    assert weight._in_backward_optimizers == []  # no live optimizer on meta

    materialize(model, "cpu")
    model.load_state_dict(reference.state_dict())
    assert all(not p.is_meta and len(p._in_backward_optimizers) == 1 for p in model.parameters())
    ref_opts = [torch.optim.Adam(reference.dense.parameters(), lr=0.01),
                torch.optim.Adagrad(reference.ebc.parameters(), lr=0.1)]
    _train_against(model, reference, ref_opts)


def test_a_plain_to_empty_is_refused_by_get_optimizers_naming_the_parameter():
    model = TinyModel(device="meta")
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.01})
    model.to_empty(device="cpu")  # torch builds new Parameter objects here
    lost = r"'ebc\.embedding_bags\.t0\.weight' was annotated on the meta device \(Adam\) and replaced"
    with pytest.raises(ValueError, match=lost):
        get_optimizers(model)
    # The record lives on the model's modules: a model built afresh, left bare, is the user's to train.
    with pytest.warns(UserWarning, match=r"6 trainable parameter\(s\) have no in-backward optimizer"):
        get_optimizers(TinyModel())


def test_carry_over_annotates_and_clips_what_to_empty_replaced_exactly_as_on_meta():
    reference = TinyModel()
    model = TinyModel(device="meta")
    apply_optimizer_in_backward(torch.optim.Adam, model.dense.parameters(), {"lr": 0.01})
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.1})
    clip = overlap_optim.apply_gradient_clipping(model.dense.parameters(), max_norm=1e-3)
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    assert sorted(carry_over(model)) == sorted(n for n, _ in model.named_parameters())
    assert carry_over(model) == []  # once
    assert all(overlap_optim.clipping.clipping_of(p) is clip for p in model.dense.parameters())
    ref_opts = [torch.optim.Adam(reference.dense.parameters(), lr=0.01),
                torch.optim.Adagrad(reference.ebc.parameters(), lr=0.1)]
    clipped = list(reference.dense.parameters())
    _train_against(model, reference, ref_opts, before_step=lambda: torch.nn.utils.clip_grad_norm_(clipped, 1e-3))




def test_a_meta_parameter_tied_into_a_module_after_its_annotation_is_carried_there_too(monkeypatch):
    """Annotating scans nothing (no ``gc``); a parameter tied into another module after it was
    annotated, and one written into ``_parameters`` behind torch's registration hook, are both
    re-annotated at their places after a plain ``to_empty``."""
    import gc

    monkeypatch.setattr(gc, "get_referrers", lambda *a: pytest.fail("annotation scanned the heap"))
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 3, device="meta"), "b": torch.nn.Linear(3, 3, device="meta"),
                                 "c": torch.nn.Linear(3, 3, device="meta")})
    apply_optimizer_in_backward(torch.optim.Adam, [model.a.weight, model.c.weight], {"lr": 0.01})
    model.b.weight = model.a.weight  # tied after the annotation
    model.c._parameters["weight"] = hidden = torch.nn.Parameter(torch.empty(3, 3, device="meta"))
    apply_optimizer_in_backward(torch.optim.SGD, [hidden], {"lr": 0.1})  # never seen by torch's hook
    assert carry_over(model) == []  # nothing replaced yet; the walk records ``c.weight``
    model.to_empty(device="cpu")
    assert sorted(carry_over(model)) == ["a.weight", "b.weight", "c.weight"]
    assert [overlap_optim.record.group_of(model[m].weight).spec.name for m in "abc"] == ["Adam", "Adam", "SGD"]
    assert all(overlap_optim.record.group_of(model[m].bias) is None for m in "abc")


def test_a_parameter_registered_in_place_of_an_annotated_one_takes_its_annotation():
    """``setattr`` (``register_parameter``: what tensor parallelism's ``parallelize_module`` calls)
    of a parameter of the same shape and dtype: it is annotated and clipped as its predecessor was,
    steps as torch.optim does, and the predecessor leaves its group."""
    torch.manual_seed(0)
    model, reference = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    group = overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.1})
    clip = overlap_optim.apply_gradient_clipping(model.parameters(), max_norm=0.1)
    old = model.weight
    model.weight = torch.nn.Parameter(old.detach().clone())
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    ref_opt.step()
    assert torch.allclose(model.weight, reference.weight, atol=1e-7) and not torch.equal(model.weight, old)
    assert clip.total_norm.item() == pytest.approx(norm.item(), rel=1e-6)
    assert all(p is not old for p in group.param_group["params"]) and len(group.param_group["params"]) == 2


def test_a_parameter_registered_in_place_of_an_annotated_one_it_cannot_take_is_refused():
    """Another shape: the annotation cannot follow, and the model would train nothing there. The
    next forward and ``get_optimizers`` refuse it by name, until the new parameter is annotated."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.1})
    model[0].weight = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"'0.weight' was annotated \(\(2, 3\) torch.float32 \(Adam\)\)"):
        overlap_optim.get_optimizers(model)
    with pytest.raises(ValueError, match=r"'weight' was annotated .* it would train nothing"):
        model(torch.zeros(1, 3))
    overlap_optim.apply_optimizer_in_backward(torch.optim.SGD, [model[0].weight], {"lr": 0.1})
    model[0].bias.data = model[0].bias.data.double()
    model(torch.zeros(1, 3, dtype=torch.float64)).sum().backward()  # annotated again: trains
    overlap_optim.get_optimizers(model)
