"""get_optimizers: the KeyedOptimizer contract, state-dict round trips and load errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from _models import TinyModel, assert_moved, assert_same_params, clone_params, loss_of, make_batch
from overlap_optim import apply_optimizer_in_backward, get_optimizers, unoptimized_parameters

SETTINGS = {
    "adam": (torch.optim.Adam, {"lr": 0.05, "amsgrad": True}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.2, "lr_decay": 0.1}),
    "rowwise-adagrad": (RowWiseAdagrad, {"lr": 0.2}),
}


def _annotated(table_setting, seed: int = 0) -> TinyModel:
    model = TinyModel(seed=seed)
    cls, kwargs = table_setting
    apply_optimizer_in_backward(cls, model.ebc.parameters(), kwargs)
    apply_optimizer_in_backward(torch.optim.AdamW, model.dense.parameters(), {"lr": 0.02})
    return model


def _train(model, generator, steps: int) -> None:
    for _ in range(steps):
        loss_of(model, make_batch(generator)).backward()


def _snapshot(model, keyed) -> dict:
    state = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
             for k, s in keyed.state_dict()["state"].items()}
    return {"weights": clone_params(model), "state": state,
            "groups": copy.deepcopy(keyed.state_dict()["param_groups"])}


def _assert_unchanged(model, keyed, before: dict) -> None:
    after = _snapshot(model, keyed)
    assert after["groups"] == before["groups"]
    assert after["state"].keys() == before["state"].keys()
    for key, state in before["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(after["state"][key][name]), torch.as_tensor(value)), (key, name)
    for name, value in before["weights"].items():
        assert torch.equal(after["weights"][name], value), name


def test_is_a_keyed_optimizer_keyed_by_fqn():
    model = _annotated(SETTINGS["adam"])
    keyed = get_optimizers(model)
    assert isinstance(keyed, KeyedOptimizer)
    assert set(keyed.params) == {n for n, _ in model.named_parameters()}
    fresh = keyed.state_dict()  # every entry, as TorchRec's fused optimizers; all placeholders
    assert fresh["placeholders"] == sorted(fresh["state"]) == sorted(keyed.params)
    _train(model, torch.Generator().manual_seed(0), 1)
    real = keyed.state_dict()
    assert real["placeholders"] == []
    state = real["state"]  # the same object sees the new state
    assert set(state["ebc.embedding_bags.t0.weight"]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    groups = keyed.state_dict()["param_groups"]
    assert [g["optimizer"] for g in groups] == ["torch.optim.adam.Adam", "torch.optim.adamw.AdamW"]
    assert groups[0]["params"] == ["ebc.embedding_bags.t0.weight", "ebc.embedding_bags.t1.weight"]


@pytest.mark.parametrize("setting", SETTINGS, ids=list(SETTINGS))
def test_save_load_into_fresh_model_equals_uninterrupted(setting, tmp_path):
    straight = _annotated(SETTINGS[setting])
    before = clone_params(straight)
    straight_gen = torch.Generator().manual_seed(5)
    _train(straight, straight_gen, 3)
    get_optimizers(straight).param_groups[1]["lr"] = 0.05
    _train(straight, straight_gen, 3)
    assert_moved(straight, before)

    first = _annotated(SETTINGS[setting])
    generator = torch.Generator().manual_seed(5)
    _train(first, generator, 3)
    get_optimizers(first).param_groups[1]["lr"] = 0.05  # saved hyperparameters come back too
    torch.save({"model": first.state_dict(), "optim": get_optimizers(first).state_dict()}, tmp_path / "ck.pt")

    resumed = _annotated(SETTINGS[setting], seed=1)  # other initial weights: the load must set them
    checkpoint = torch.load(tmp_path / "ck.pt", weights_only=False)
    resumed.load_state_dict(checkpoint["model"])
    get_optimizers(resumed).load_state_dict(checkpoint["optim"])
    _train(resumed, generator, 3)
    assert_same_params(resumed, straight, 6)


def test_step_and_zero_grad_do_no_work_but_step_runs_a_closure():
    model = _annotated(SETTINGS["adam"])
    keyed = get_optimizers(model)
    before = clone_params(model)
    assert keyed.step() is None
    keyed.zero_grad()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    batch = make_batch(torch.Generator().manual_seed(0))

    def closure():
        loss = loss_of(model, batch)
        loss.backward()
        return loss

    assert torch.is_tensor(keyed.step(closure))
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_warns_once_listing_unannotated_parameters():
    model = TinyModel()
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.1})
    with pytest.warns(UserWarning, match=r"4 trainable parameter\(s\).*\['dense.0.bias', 'dense.0.weight'"):
        keyed = get_optimizers(model)
    assert set(keyed.params) == {"ebc.embedding_bags.t0.weight", "ebc.embedding_bags.t1.weight"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_optimizers(model)  # once per model: no second warning
    assert set(unoptimized_parameters(model)) == {"dense.0.weight", "dense.0.bias", "dense.2.weight", "dense.2.bias"}
    user = torch.optim.SGD(unoptimized_parameters(model).values(), lr=0.1)
    loss_of(model, make_batch(torch.Generator().manual_seed(0))).backward()
    before = model.dense[0].weight.detach().clone()
    user.step()
    assert not torch.equal(before, model.dense[0].weight)
    with pytest.raises(TypeError, match="get_optimizers takes an nn.Module, got list"):
        get_optimizers([model])


def test_init_state_is_a_placeholder_that_keeps_training_exact():
    model = _annotated(SETTINGS["adam"])
    reference = _annotated(SETTINGS["adam"])
    keyed = get_optimizers(model)
    before = clone_params(model)
    keyed.init_state()
    assert set(keyed.state_dict()["state"]) == set(keyed.params)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    for gen_seed in (7,):
        _train(model, torch.Generator().manual_seed(gen_seed), 3)
        _train(reference, torch.Generator().manual_seed(gen_seed), 3)
    assert_same_params(model, reference, 3)


def test_init_state_then_load_resumes_exactly():
    source = _annotated(SETTINGS["sgd-momentum"])
    generator = torch.Generator().manual_seed(9)
    _train(source, generator, 2)
    saved = copy.deepcopy(get_optimizers(source).state_dict())
    target = _annotated(SETTINGS["sgd-momentum"])
    target.load_state_dict(source.state_dict())
    keyed = get_optimizers(target)
    keyed.init_state()
    keyed.load_state_dict(saved)
    _train(source, copy.deepcopy(generator), 2)
    _train(target, generator, 2)
    assert_same_params(target, source, 4)


def _trained_with_state():
    model = _annotated(SETTINGS["adam"])
    _train(model, torch.Generator().manual_seed(0), 2)
    return model, get_optimizers(model)


def _adam_state_dict():
    return copy.deepcopy(_trained_with_state()[1].state_dict())


def _drop_key(sd):
    del sd["state"]["dense.0.bias"]
    sd["param_groups"][1]["params"].remove("dense.0.bias")
    return sd


def _extra_key(sd):
    sd["state"]["dense.9.weight"] = sd["state"]["dense.0.weight"]
    return sd


def _bad_shape(sd):
    sd["state"]["ebc.embedding_bags.t1.weight"]["exp_avg"] = torch.zeros(3, 4)
    return sd


def _sgd_state(sd):
    model = _annotated(SETTINGS["sgd-momentum"])
    _train(model, torch.Generator().manual_seed(0), 1)
    return copy.deepcopy(get_optimizers(model).state_dict())


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (_drop_key, r"missing keys \['dense.0.bias'\], unexpected keys \[\]"),
        (_extra_key, r"missing keys \[\], unexpected keys \['dense.9.weight'\]"),
        (_bad_shape, r"shape mismatch for 'ebc.embedding_bags.t1.weight' state 'exp_avg': saved \(3, 4\), "
                     r"expected \(12, 4\)"),
        (_sgd_state, r"optimizer mismatch for 'ebc.embedding_bags.t0.weight': the state dict holds "
                     r"torch.optim.sgd.SGD state, the model now has torch.optim.adam.Adam"),
        (lambda sd: {"model": sd}, r"not an optimizer state dict"),
    ],
    ids=["missing", "unexpected", "shape", "optimizer", "not-a-state-dict"],
)
def test_bad_state_dict_raises_and_changes_nothing(corrupt, match):
    model, keyed = _trained_with_state()
    before = _snapshot(model, keyed)
    with pytest.raises(ValueError, match=match):
        keyed.load_state_dict(corrupt(_adam_state_dict()))
    _assert_unchanged(model, keyed, before)


def test_state_names_are_checked_without_param_groups():
    model, keyed = _trained_with_state()
    before = _snapshot(model, keyed)
    sd = _sgd_state(None)
    sd.pop("param_groups")
    for key in keyed.params:  # every key present, the state of another optimizer
        sd["state"].setdefault(key, {"momentum_buffer": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"optimizer mismatch for '.*': saved state names \['momentum_buffer'\]"):
        keyed.load_state_dict(sd)
    _assert_unchanged(model, keyed, before)
