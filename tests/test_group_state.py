"""Optimizers that keep state in their param group (pytorch-optimizer's LAMB, LARS, GaLore) and
read settings from it (GaLore's group options), against the package's own optimizer.

Reference: the same class from pytorch-optimizer, one instance per parameter, built as a user
would (GaLore's options set on its param group), stepped after backward.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from pytorch_optimizer import LARS, GaLore, Lamb

from overlap_optim import apply_optimizer_in_backward, get_optimizers

GALORE_OPTIONS = {"rank": 2, "update_proj_gap": 2, "scale": 0.25, "projection_type": "std"}
CASES = [
    ("lamb", Lamb, {"lr": 0.02, "weight_decay": 0.01}, None),
    ("lars", LARS, {"lr": 0.5, "momentum": 0.9, "trust_coefficient": 0.02}, None),
    ("galore", GaLore, {"lr": 0.02}, GALORE_OPTIONS),
]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


def _train(model, optimizers, steps, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(8, 6, generator=generator)).pow(2).mean().backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def _reference(model, cls, kwargs, options):
    optimizers = [cls([p], **kwargs) for p in model.parameters()]
    for opt in optimizers:
        opt.param_groups[0].update(options or {})
    return optimizers


@pytest.mark.parametrize("name, cls, kwargs, options", CASES, ids=[c[0] for c in CASES])
def test_group_state_is_kept_per_parameter_and_survives_a_checkpoint(name, cls, kwargs, options):
    reference, ours = _model(), _model()
    start = [p.detach().clone() for p in reference.parameters()]
    ref_opts = _reference(reference, cls, kwargs, options)
    apply_optimizer_in_backward(cls, ours.parameters(), kwargs, group_options=options)
    _train(reference, ref_opts, 3, seed=1)
    _train(ours, [], 3, seed=1)
    saved = copy.deepcopy(get_optimizers(ours).state_dict())
    assert all(s["step"] == 3 for s in saved["state"].values()), "the group's step counter, per parameter"
    resumed = _model()
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), ours.parameters()):
            p.copy_(q)
    apply_optimizer_in_backward(cls, resumed.parameters(), kwargs, group_options=options)
    get_optimizers(resumed).load_state_dict(saved)
    _train(reference, ref_opts, 3, seed=2)
    _train(resumed, [], 3, seed=2)
    for (n, p), q in zip(resumed.named_parameters(), reference.parameters()):
        diff = (p.detach() - q.detach()).abs().max().item()
        assert diff <= 1e-6, f"{name}, {n}: {diff:.3g} from {cls.__name__} after a checkpoint at step 3"
    assert min((q.detach() - s).abs().max().item() for q, s in zip(reference.parameters(), start)) > 1e-3


def test_group_options_are_checked_where_they_enter():
    params = _model().parameters()
    with pytest.raises(ValueError, match=r"group_options \['lr'\] are GaLore constructor arguments"):
        apply_optimizer_in_backward(GaLore, params, {"lr": 0.1}, group_options={"lr": 0.2})
    with pytest.raises(TypeError, match="group_options must be a dict"):
        apply_optimizer_in_backward(GaLore, params, {"lr": 0.1}, group_options=[("rank", 2)])
    with pytest.raises(TypeError, match=r"GaLore does not take the kwarg\(s\) \['rank'\]"):
        apply_optimizer_in_backward(GaLore, params, {"lr": 0.1, "rank": 2})  # a misspelled constructor kwarg


@pytest.fixture(scope="module")
def dense_ranks(request):
    from overlap_optim.testing import run_cases, selected_cases
    from _layerwise_bodies import DENSE_CASES, dense_layerwise

    cases = {name: partial(dense_layerwise, name=name) for name in DENSE_CASES}  # one spawned group
    return run_cases(cases, selected_cases(request, cases), timeout=300)


@pytest.mark.parametrize("case", ["muon+adam", "adafactor", "lamb", "lars", "galore"])
def test_layerwise_optimizers_on_dense_parameters_through_the_ddp_hook(dense_ranks, case):
    """2 ranks; compared with the reference on the global batch after every step, in the ranks."""
    for moved in dense_ranks[case]:
        assert moved > 1e-3, f"{case}: the reference moved only {moved}"
