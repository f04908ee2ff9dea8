"""One multi-tensor update per virtual group equals torch.optim with one param group per tensor.

Reference: plain ``torch.optim`` (its default, single-tensor path: ``foreach=False``), one param
group per tensor, each with its own float settings and its own LambdaLR. Ours: one
:func:`multi_tensor_step` call per step over all tensors, reading the same live param groups.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from overlap_optim.spec import describe_optimizer
from overlap_optim.virtual_groups import MULTI_TENSOR, multi_tensor_step, virtual_key

# (class, fixed settings, float settings per tensor i)
CASES = [
    ("sgd", torch.optim.SGD, {}, lambda i: {"lr": 0.05 * (i + 1), "weight_decay": 0.01 * i}),
    ("sgd_momentum", torch.optim.SGD, {}, lambda i: {"lr": 0.05 * (i + 1), "momentum": 0.3 * (i % 3),
                                                     "dampening": 0.1 * i}),
    ("sgd_nesterov", torch.optim.SGD, {"nesterov": True, "momentum": 0.9}, lambda i: {"lr": 0.05 * (i + 1), "momentum": 0.5 + 0.1 * i}),
    ("adam", torch.optim.Adam, {}, lambda i: {"lr": 0.01 * (i + 1), "betas": (0.8 + 0.03 * i, 0.99 - 0.002 * i),
                                              "eps": 10.0 ** -(6 + i), "weight_decay": 0.02 * i}),
    ("adam_amsgrad_max", torch.optim.Adam, {"amsgrad": True, "maximize": True}, lambda i: {"lr": 0.01 * (i + 1)}),
    ("adamw", torch.optim.AdamW, {}, lambda i: {"lr": 0.01 * (i + 1), "weight_decay": 0.05 * (i + 1)}),
    # torch's Adagrad takes initial_accumulator_value from its constructor only, not per group
    ("adagrad", torch.optim.Adagrad, {"initial_accumulator_value": 0.1}, lambda i: {"lr": 0.1 * (i + 1),
                                                    "lr_decay": 0.05 * i, "weight_decay": 0.01 * i}),
    ("rmsprop", torch.optim.RMSprop, {}, lambda i: {"lr": 0.01 * (i + 1), "alpha": 0.9 + 0.02 * i,
                                                    "momentum": 0.4 * (i % 2), "weight_decay": 0.01 * i}),
    ("rmsprop_centered", torch.optim.RMSprop, {"centered": True}, lambda i: {"lr": 0.01 * (i + 1), "momentum": 0.3}),
    ("adamax", torch.optim.Adamax, {}, lambda i: {"lr": 0.02 * (i + 1), "betas": (0.85 + 0.03 * i, 0.99),
                                                  "weight_decay": 0.01 * i}),
    ("nadam", torch.optim.NAdam, {}, lambda i: {"lr": 0.02 * (i + 1), "momentum_decay": 0.004 * (i + 1),
                                                "weight_decay": 0.01 * i}),
    ("nadam_decoupled", torch.optim.NAdam, {"decoupled_weight_decay": True},
     lambda i: {"lr": 0.02 * (i + 1), "weight_decay": 0.05 * (i + 1)}),
    ("radam", torch.optim.RAdam, {}, lambda i: {"lr": 0.02 * (i + 1), "betas": (0.9, 0.9 + 0.02 * i),
                                                "weight_decay": 0.01 * i}),
    ("radam_decoupled", torch.optim.RAdam, {"decoupled_weight_decay": True},
     lambda i: {"lr": 0.02 * (i + 1), "weight_decay": 0.05}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_multi_tensor_update_equals_torch_optim_with_a_group_per_tensor(case):
    _, cls, fixed, floats = case
    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (2, 2, 2), (4, 6)]
    start = [torch.randn(s) for s in shapes]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    ours = [t.clone() for t in start]
    reference = cls([{"params": [p], **fixed, **floats(i)} for i, p in enumerate(ref)], foreach=False, **fixed)
    spec = describe_optimizer(cls, fixed)
    lambdas = [lambda step, i=i: 1.0 / (1 + 0.3 * i * step) for i in range(len(shapes))]
    schedule = torch.optim.lr_scheduler.LambdaLR(reference, lambdas)  # one per tensor; ours reads the live groups
    states = [{} for _ in shapes]
    assert len({virtual_key(spec, g, t) for g, t in zip(reference.param_groups, ours)}) == 1
    for step in range(6):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        multi_tensor_step(spec, ours, [g.clone() for g in grads], states, reference.param_groups)
        reference.step()
        schedule.step()
        for i, (mine, theirs) in enumerate(zip(ours, ref)):
            diff = (mine - theirs.detach()).abs().max().item()
            assert diff <= 1e-6, f"{case[0]}: step {step}, tensor {i}: {diff:.3g}"
            assert set(states[i]) == set(reference.state[theirs]), (states[i].keys(), reference.state[theirs].keys())
    moved = min((p.detach() - s).abs().max().item() for p, s in zip(ref, start))
    assert moved > 1e-3, f"{case[0]}: the reference moved only {moved}"


def test_who_shares_a_virtual_group():
    t = torch.zeros(3)
    adam, adam_ams = describe_optimizer(torch.optim.Adam, {}), describe_optimizer(torch.optim.Adam, {"amsgrad": True})
    group = {"lr": 0.1}
    assert virtual_key(adam, group, t) == virtual_key(describe_optimizer(torch.optim.Adam, {"lr": 0.5}), group, t)
    assert virtual_key(adam, group, t) != virtual_key(adam_ams, group, t)  # a fixed setting differs
    assert virtual_key(adam, group, t) != virtual_key(adam, group, t.double())  # dtype differs
    assert virtual_key(adam, {"foreach": True}, t) is None  # the user asked for torch's own path
    assert virtual_key(describe_optimizer(torch.optim.ASGD, {}), group, t) is None  # no multi-tensor update
    assert set(MULTI_TENSOR) == {torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                                 torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam}


# -- 2 ranks (gloo): the DDP hook and the fallback, against torch.optim, step by step.


@pytest.fixture(scope="module")
def ranks(request):
    from overlap_optim.testing import run_cases, selected_cases
    from _virtual_group_bodies import dense_per_layer, fallback_tables, optimizer_ops_per_bucket

    cases = {  # one spawned group
        "dense": dense_per_layer,
        **{f"fallback/{st}": partial(fallback_tables, sharding_type=st) for st in ("table_wise", "row_wise")},
        "fallback/row_wise/table_by_table": partial(fallback_tables, sharding_type="row_wise", step_bytes=1),
        "fallback/row_wise/no_extension": partial(fallback_tables, sharding_type="row_wise", one_pass=False),
        "ops": optimizer_ops_per_bucket,
    }
    return run_cases(cases, selected_cases(request, cases), timeout=600)


@pytest.mark.parametrize("case", ["dense"])
def test_per_layer_lrs_with_a_lambda_each_match_torch_adam_with_48_param_groups(ranks, case):
    assert all(moved > 1e-3 for moved in ranks[case]), ranks[case]  # compared every step in the ranks


@pytest.mark.parametrize("case", ["fallback/table_wise", "fallback/row_wise", "fallback/row_wise/table_by_table",
                                  "fallback/row_wise/no_extension"])
def test_six_fallback_tables_with_six_lrs_share_one_kernel_and_match_torch_optim(ranks, case):
    from overlap_optim import row_pass

    for run in ranks[case]:
        # the kernel's tables step together while their rows are few (sharders.fallback.STEP_BYTES),
        # one at a time when each table's rows pass it; exact either way (compared every step)
        per_backward = [1] * 6 if case.endswith("table_by_table") else None if case.endswith("table_wise") else [6]
        if per_backward is not None:
            assert run["chunks"] == per_backward * 4, run["chunks"]
        # Adam steps in one compiled pass where the extension is built; exact either way
        assert run["one_pass"] == {row_pass.available() and not case.endswith("no_extension")}, run["one_pass"]
        assert min(run["moved"].values()) > 1e-3, run["moved"]
        fallback = [row for row in run["rows"] if row[6].startswith("fallback")]
        assert len(fallback) == 1, run["rows"]  # one kernel per sharding group on this rank
        if case == "fallback/row_wise":  # every table has a shard here, all in that kernel
            assert fallback[0][4] == "t0, t1, t2, t3, t4, t5", fallback
        tables = fallback[0][4].split(", ")
        assert len(tables) >= 2, fallback  # one kernel, several settings: each table's shown
        for table in tables:
            i = int(table[1:])
            assert f"{table}: Adam(lr={0.02 * (i + 1)!r}, weight_decay={0.01 * i!r})" in fallback[0][5], fallback


@pytest.mark.parametrize("case", ["ops"])
def test_optimizer_ops_per_bucket_are_one_fused_call_per_setting(ranks, case):
    """Adam on CPU runs torch's fused kernel, which takes its settings as scalars: one call per
    distinct setting; the other multi-tensor ops of the bucket (the step counters) do not grow."""
    for ops in ranks[case]:
        assert ops[1]["aten::_fused_adam_"] == 1 and ops[24]["aten::_fused_adam_"] == 24, ops
        foreach = {settings: {k: v for k, v in ops[settings].items() if "_foreach_" in k} for settings in (1, 24)}
        assert foreach[24] == foreach[1], ops
