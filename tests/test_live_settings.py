"""Settings changed at run time (by hand, a scheduler or load_state_dict) reach every kernel
before the next backward, exactly as torch.optim applies them, or are refused by name.

Reference: plain torch.optim on the unsharded model, with the same change made there.
"""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch

from overlap_optim import apply_optimizer_in_backward, get_optimizers
from overlap_optim.testing import run_cases, selected_cases
from _sharded_parity import (LIVE_SETTING_ERRORS, LIVE_TABLES, assert_table_exact, live_exact, live_one_cycle,
                             live_setting_error)

EXACT = ("table_wise", "row_wise", "data_parallel")
ONE_CYCLE = ("sgd_momentum", "adam")
RANK_CASES = {f"exact/{st}": partial(live_exact, sharding_type=st) for st in EXACT}  # one spawned group
RANK_CASES.update({f"one_cycle/{name}": partial(live_one_cycle, name=name) for name in ONE_CYCLE})
RANK_CASES.update({f"refused/{case}": partial(live_setting_error, case=case) for case in LIVE_SETTING_ERRORS})


@pytest.fixture(scope="module")
def ranks(request):
    return run_cases(RANK_CASES, selected_cases(request, RANK_CASES), timeout=600)


@pytest.mark.parametrize("name", [*LIVE_TABLES, "dense"])
@pytest.mark.parametrize("case", [f"exact/{st}" for st in EXACT])
def test_lr_eps_and_weight_decay_changed_after_step_one_match_torch_optim(ranks, case, name):
    per_rank = ranks[case]
    if name != "dense":  # the MLP is compared with torch.optim after every step inside the ranks
        assert_table_exact(per_rank, name, 1e-5, case)
    assert per_rank[0]["moved"][name] >= 1e-3, f"the reference did not move {name}"


@pytest.mark.parametrize("case", [f"one_cycle/{name}" for name in ONE_CYCLE])
def test_one_cycle_lr_cycling_momentum_and_betas_matches_torch_optim(ranks, case):
    name = case.split("/")[1]
    assert ranks[case][0][name] > 1e-3, name


def _refused(case, pattern):
    return pytest.param(f"refused/{case}", pattern, id=f"refused/{case}")


@pytest.mark.parametrize("case, pattern", [
    _refused("fused_adagrad_weight_decay",
             r"ValueError: fused table\(s\) \['t_ada'\]: weight_decay=0.01: FBGEMM's EXACT_ADAGRAD has no .* changed "
             r"at run time \(\[.weight_decay: 0 -> 0.01.\]\).*fallback_tables=\[\.\.\.\]"),
    _refused("fused_sgd_one_cycle",
             r"ValueError: fused table\(s\) \['t_sgd'\]: momentum=0.9\d*: FBGEMM's EXACT_SGD has no momentum.*"
             r"Annotate the table with that setting from the start"),
    _refused("fallback_sgd_momentum",
             r"ValueError: table 't_sgd': SGD now keeps state \['momentum_buffer'\] .*\['momentum: 0 -> 0.9'\]"),
    _refused("fallback_adam_amsgrad",
             r"ValueError: table 't_adam': Adam's setting amsgrad=True was changed at run time \(annotated with False\)"),
    _refused("data_parallel_adam_amsgrad",
             r"Adam's setting amsgrad=True was changed at run time \(annotated with False\); only its float settings"),
    _refused("dense_adam_amsgrad",
             r"ValueError: param group \d+ \(Adam: dense\.[^)]*\): Adam's setting amsgrad=True was changed at run time"),
])
def test_changes_a_kernel_cannot_apply_are_refused_by_table_and_setting(ranks, case, pattern):
    error = ranks[case][0]
    assert re.search(pattern, error), error


def _dense_pair():
    torch.manual_seed(0)
    ours = torch.nn.Linear(4, 3)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(ours.state_dict())
    apply_optimizer_in_backward(torch.optim.Adam, ours.parameters(), {"lr": 0.05})
    return ours, ref, torch.optim.Adam(ref.parameters(), lr=0.05)


def test_dense_parameter_sees_eps_weight_decay_and_lr_changes_like_torch_optim():
    ours, ref, ref_opt = _dense_pair()
    opt = get_optimizers(ours)
    start = ref.weight.detach().clone()
    for step in range(4):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        ours(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 0:
            for group in (opt.param_groups[0], ref_opt.param_groups[0]):
                group.update(lr=0.02, eps=0.5, weight_decay=0.1, betas=(0.5, 0.9))
        torch.testing.assert_close(ours.weight.detach(), ref.weight.detach(), rtol=0, atol=1e-6)
    assert (ref.weight.detach() - start).abs().max() > 1e-2


def test_dense_parameter_refuses_a_non_float_setting_changed_at_run_time():
    ours, _, _ = _dense_pair()
    get_optimizers(ours).param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"param group 0 \(Adam: bias, weight\): Adam's setting "
                                         r"amsgrad=True was changed at run time \(annotated with False\)"):
        ours(torch.randn(2, 4)).sum().backward()


def test_a_changed_setting_is_refused_before_any_group_steps():
    """Adam on the bias, GaLore on the weight; GaLore's rank changed after a step. Refused at the next
    forward, naming the weight and the setting, with nothing stepped: the refusal came in backward, after
    the bias had stepped (and the same for Adafactor's maximize)."""
    from pytorch_optimizer import GaLore

    galore = {"rank": 2, "update_proj_gap": 2, "scale": 0.25, "projection_type": "std"}
    for cls, options, key, value in ((GaLore, galore, "rank", 3),
                                     (torch.optim.Adafactor, None, "maximize", True)):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 8)
        apply_optimizer_in_backward(torch.optim.Adam, [model.bias], {"lr": 0.05})
        apply_optimizer_in_backward(cls, [model.weight], {"lr": 0.05}, group_options=options)
        opt = get_optimizers(model)
        model(torch.randn(3, 6)).sum().backward()
        opt.param_groups[1][key] = value
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=rf"param group 1 \({cls.__name__}: weight\): {cls.__name__}'s setting "
                                             rf"{key}={value} was changed at run time"):
            model(torch.randn(3, 6)).sum().backward()
        assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("case, pattern", [
    _refused("table_wise_fused_adagrad_weight_decay",
             r"ValueError: fused table\(s\) \['t_ada'\]: weight_decay=0.01: FBGEMM's EXACT_ADAGRAD has no .* changed "
             r"at run"),
    _refused("table_wise_fallback_adam_amsgrad",
             r"ValueError: table 't_adam': Adam's setting amsgrad=True was changed at run time \(annotated with False\)"),
])
def test_a_refusal_on_a_table_held_by_one_rank_is_raised_on_every_rank(ranks, case, pattern):
    """Before sharders/live_settings.py the rank without the table went on to the next all-to-all
    and waited there: the group hung until the harness killed it."""
    errors = ranks[case]
    assert re.search(pattern, errors[0]), errors[0]
    assert errors[1] == errors[0]
