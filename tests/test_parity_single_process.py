"""In-backward updates match plain torch.optim, step by step, in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from _models import TinyModel, assert_moved, assert_same_params, clone_params, loss_of, make_batch
from overlap_optim import apply_optimizer_in_backward, get_optimizers

# (id, class, kwargs) for the table under test, ebc.embedding_bags["t0"].
CASES = [
    ("sgd", torch.optim.SGD, {"lr": 0.1}),
    ("sgd-momentum", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1}),
    ("sgd-nesterov", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("sgd-wd", torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.05}),
    ("adagrad", torch.optim.Adagrad, {"lr": 0.2}),
    ("adagrad-lr-decay", torch.optim.Adagrad, {"lr": 0.2, "lr_decay": 0.1}),
    ("adagrad-init-acc", torch.optim.Adagrad, {"lr": 0.2, "initial_accumulator_value": 0.3}),
    ("adagrad-wd", torch.optim.Adagrad, {"lr": 0.2, "weight_decay": 0.05, "eps": 1e-6}),
    ("adam", torch.optim.Adam, {"lr": 0.05}),
    ("adam-amsgrad", torch.optim.Adam, {"lr": 0.05, "amsgrad": True, "betas": (0.8, 0.9)}),
    ("adamw", torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    ("adamw-amsgrad", torch.optim.AdamW, {"lr": 0.05, "amsgrad": True}),
    ("rmsprop", torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    ("rowwise-adagrad", RowWiseAdagrad, {"lr": 0.2, "weight_decay": 0.01}),
]
# The other parts keep one optimizer each, different from the case's.
T1 = (torch.optim.Adagrad, {"lr": 0.1})
DENSE = (torch.optim.Adam, {"lr": 0.02})
STEPS = 5


def _annotate(model: TinyModel, t0: tuple) -> None:
    apply_optimizer_in_backward(t0[0], model.ebc.embedding_bags["t0"].parameters(), t0[1])
    apply_optimizer_in_backward(T1[0], model.ebc.embedding_bags["t1"].parameters(), T1[1])
    apply_optimizer_in_backward(DENSE[0], model.dense.parameters(), DENSE[1])


def _reference_optimizers(reference: TinyModel, t0: tuple) -> list[torch.optim.Optimizer]:
    return [
        t0[0](reference.ebc.embedding_bags["t0"].parameters(), **t0[1]),
        T1[0](reference.ebc.embedding_bags["t1"].parameters(), **T1[1]),
        DENSE[0](reference.dense.parameters(), **DENSE[1]),
    ]


def _reference_step(reference: TinyModel, optimizers: list, batch: tuple) -> None:
    loss_of(reference, batch).backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def _train_scheduled(model, reference, ref_opts, keyed, schedulers, steps, seed):
    """Backward, step, then every scheduler (ours and the reference's); compare each step."""
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        batch = make_batch(generator)
        loss_of(model, batch).backward()
        keyed.step()
        _reference_step(reference, ref_opts, batch)
        for scheduler in schedulers:
            scheduler.step()
        assert_same_params(model, reference, step)
    return generator


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_step_matches_torch_optim(case):
    _, cls, kwargs = case
    model = TinyModel()
    reference = copy.deepcopy(model)
    before = clone_params(reference)
    _annotate(model, (cls, kwargs))
    ref_opts = _reference_optimizers(reference, (cls, kwargs))
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        batch = make_batch(generator)
        loss_of(model, batch).backward()
        assert all(p.grad is None for p in model.parameters()), "grads not released"
        _reference_step(reference, ref_opts, batch)
        assert_same_params(model, reference, step)
    assert_moved(reference, before)


def test_lambda_and_step_lr_match_torch_schedulers():
    model = TinyModel()
    reference = copy.deepcopy(model)
    _annotate(model, (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))
    ref_opts = _reference_optimizers(reference, (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))
    keyed = get_optimizers(model)
    warmup = lambda step: min(1.0, (step + 1) / 3)  # noqa: E731
    schedulers = [torch.optim.lr_scheduler.LambdaLR(keyed, warmup), torch.optim.lr_scheduler.StepLR(keyed, 2, 0.5)]
    ref_schedulers = [s for o in ref_opts for s in (
        torch.optim.lr_scheduler.LambdaLR(o, warmup), torch.optim.lr_scheduler.StepLR(o, 2, 0.5))]
    _train_scheduled(model, reference, ref_opts, keyed, schedulers + ref_schedulers, 6, seed=2)
    assert [g["lr"] for g in keyed.param_groups] == [o.param_groups[0]["lr"] for o in ref_opts]
    assert keyed.param_groups[0]["lr"] < 0.1, "the schedule never changed the rate"


def test_per_group_lambdas_and_hand_set_lr_reach_the_next_backward():
    model = TinyModel()
    reference = copy.deepcopy(model)
    _annotate(model, (torch.optim.Adam, {"lr": 0.05}))
    ref_opts = _reference_optimizers(reference, (torch.optim.Adam, {"lr": 0.05}))
    keyed = get_optimizers(model)
    lambdas = [lambda s: 0.5**s, lambda s: 1.0 + s, lambda s: 1.0]
    scheduler = torch.optim.lr_scheduler.LambdaLR(keyed, lambdas)
    ref_schedulers = [torch.optim.lr_scheduler.LambdaLR(o, f) for o, f in zip(ref_opts, lambdas)]
    generator = _train_scheduled(model, reference, ref_opts, keyed, [scheduler, *ref_schedulers], 4, seed=3)
    keyed.param_groups[2]["lr"] = ref_opts[2].param_groups[0]["lr"] = 0.3
    batch = make_batch(generator)
    loss_of(model, batch).backward()
    _reference_step(reference, ref_opts, batch)
    assert_same_params(model, reference, 99)


def test_shared_parameter_steps_once_on_the_summed_grad():
    lin = torch.nn.Linear(3, 3)
    ref = copy.deepcopy(lin)
    apply_optimizer_in_backward(torch.optim.SGD, lin.parameters(), {"lr": 0.1, "momentum": 0.9})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 3)
    for step in range(3):
        lin(lin(x)).sum().backward()  # the weight is used twice
        ref(ref(x)).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_same_params(lin, ref, step)


SCHEDULES = {
    # Momentum can cycle only when every group has the same kind (see the next test).
    "one_cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10, cycle_momentum=False),
    "warmup_then_decay": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
         torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8)],
        milestones=[3],
    ),
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_torch_schedulers_drive_get_optimizers_like_torch_optim(name):
    """Ten steps of each scheduler, momentum/betas cycling included (OneCycleLR)."""
    model = TinyModel()
    reference = copy.deepcopy(model)
    before = clone_params(reference)
    _annotate(model, (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))
    ref_opts = _reference_optimizers(reference, (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))
    keyed = get_optimizers(model)
    scheduler = SCHEDULES[name](keyed)
    ref_schedulers = [SCHEDULES[name](o) for o in ref_opts]
    _train_scheduled(model, reference, ref_opts, keyed, [scheduler, *ref_schedulers], 10, seed=4)
    assert_moved(reference, before)


def test_one_cycle_also_cycles_momentum_when_every_group_has_it():
    lin = torch.nn.Linear(3, 3)
    ref = copy.deepcopy(lin)
    apply_optimizer_in_backward(torch.optim.SGD, [lin.weight], {"lr": 0.1, "momentum": 0.9})
    apply_optimizer_in_backward(torch.optim.SGD, [lin.bias], {"lr": 0.05, "momentum": 0.8})
    ref_opt = torch.optim.SGD([{"params": [ref.weight], "lr": 0.1, "momentum": 0.9},
                               {"params": [ref.bias], "lr": 0.05, "momentum": 0.8}])
    keyed = get_optimizers(lin)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(keyed, max_lr=[0.2, 0.1], total_steps=6)
    ref_scheduler = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=[0.2, 0.1], total_steps=6)
    x = torch.randn(4, 3)
    for step in range(6):
        lin(x).square().sum().backward()
        ref(x).square().sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        keyed.step()
        scheduler.step()
        ref_scheduler.step()
        assert keyed.param_groups[0]["momentum"] == ref_opt.param_groups[0]["momentum"]
        assert_same_params(lin, ref, step)
