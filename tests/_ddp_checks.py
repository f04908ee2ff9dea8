"""Rank bodies for the dense-hook tests (spawned; not collected by pytest)."""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from overlap_optim import apply_optimizer_in_backward, get_optimizers, register_optimizer_hook
from overlap_optim.record import group_of


def tower(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


# name -> list of (module index, optimizer class, kwargs); indices 0, 2, 4 are the Linears.
CASES = {
    "sgd_momentum": [(i, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}) for i in (0, 2, 4)],
    "adam": [(i, torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}) for i in (0, 2, 4)],
    "adamw": [(i, torch.optim.AdamW, {"lr": 0.01, "amsgrad": True}) for i in (0, 2, 4)],
    "rmsprop": [(i, torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}) for i in (0, 2, 4)],
    "three_lrs_two_classes": [
        (0, torch.optim.Adam, {"lr": 0.01}),
        (2, torch.optim.Adam, {"lr": 0.003, "betas": (0.8, 0.99)}),
        (4, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    ],
    "adagrad_per_param": [(i, torch.optim.Adagrad, {"lr": 0.05}) for i in (0, 2, 4)],  # not fused: own step
    # torch's own kernels asked for: each annotation call's share of a bucket in one torch.optim call
    "fused_and_foreach": [
        (0, torch.optim.Adam, {"lr": 0.01, "fused": True}),
        (2, torch.optim.AdamW, {"lr": 0.003, "fused": True}),
        (4, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "foreach": True}),
    ],
}


def _data(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(5, 6, generator=generator), torch.randn(5, 1, generator=generator)


def _pair(case, comm="allreduce", bucket_cap_mb=25.0, unannotated_bias=False):
    model = tower()
    reference = copy.deepcopy(model)
    ref_groups, user_params, ref_user = [], [], []
    for index, cls, kwargs in case:
        params = list(model[index].parameters())
        ref_params = list(reference[index].parameters())
        if unannotated_bias and index == 4:
            params, user_params = params[:1], params[1:]
            ref_params, ref_user = ref_params[:1], ref_params[1:]
        apply_optimizer_in_backward(cls, params, kwargs)
        ref_groups.append((cls, ref_params, kwargs))
    ours = DDP(model, bucket_cap_mb=bucket_cap_mb)
    register_optimizer_hook(ours, comm=comm)
    ref = DDP(reference, bucket_cap_mb=bucket_cap_mb)
    ref_opts = [cls(params, **kwargs) for cls, params, kwargs in ref_groups]
    user = (torch.optim.SGD(user_params, lr=0.1), torch.optim.SGD(ref_user, lr=0.1)) if user_params else None
    return ours, ref, ref_opts, user


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def parity(rank, case, comm="allreduce", bucket_cap_mb=25.0, unannotated_bias=False, steps=4, accumulate=1,
           schedule=None):
    """Train ours and plain DDP + torch.optim side by side; returns per-step max diffs,
    how far the reference moved, and whether annotated grads were None after backward.

    ``schedule``: an LR lambda applied through ``get_optimizers`` on our side and to
    every reference optimizer.
    """
    ours, ref, ref_opts, user = _pair(CASES[case], comm, bucket_cap_mb, unannotated_bias)
    schedulers = []
    if schedule is not None:
        keyed = get_optimizers(ours.module)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(keyed, schedule)]
        schedulers += [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in ref_opts]
    start = copy.deepcopy(ref.module)
    diffs, grads_none, user_grad_ok = [], True, True
    for step in range(steps):
        for micro in range(accumulate):
            x, y = _data(step, rank, micro)
            last = micro == accumulate - 1
            for model in (ours, ref):
                context = model.no_sync() if not last else _nothing()
                with context:
                    ((model(x) - y).pow(2).mean() / accumulate).backward()
        if user:
            user_grad_ok &= all(
                p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-6)
                for p, q in zip(user[0].param_groups[0]["params"], user[1].param_groups[0]["params"])
            )
            user[0].step(); user[0].zero_grad()
            user[1].step(); user[1].zero_grad()
        grads_none &= all(p.grad is None for p in ours.parameters() if group_of(p) is not None)
        for opt in ref_opts:
            opt.step()
            opt.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
        diffs.append(_max_diff(ours.module, ref.module))
    return {"diffs": diffs, "moved": _max_diff(ref.module, start), "grads_none": grads_none,
            "user_grad_ok": user_grad_ok}


def reannotated(rank, world_size, steps=4, switch=2):
    """Adam on every layer; after ``switch`` steps, annotating the middle layer anew (the same
    optimizer, another one with ``replace=True``, or an unannotated parameter) is refused: the
    parameter's own hook would step it again, on its local gradient. Nothing changed: training
    goes on equal to the reference."""
    ours, ref, ref_opts, user = _pair(CASES["adam"], bucket_cap_mb=0.0002, unannotated_bias=True)
    start = copy.deepcopy(ref.module)
    diffs, refusals = [], []
    for step in range(steps):
        if step == switch:
            for cls, params, kwargs, replace in (
                (torch.optim.Adam, ours.module[2].parameters(), {"lr": 0.01, "weight_decay": 0.01}, False),
                (torch.optim.SGD, ours.module[2].parameters(), {"lr": 0.2}, True),
                (torch.optim.SGD, [ours.module[4].bias], {"lr": 0.1}, False),
            ):
                try:
                    apply_optimizer_in_backward(cls, params, kwargs, replace=replace)
                except ValueError as error:
                    refusals.append(str(error))
        x, y = _data(step, rank)
        for model in (ours, ref):
            (model(x) - y).pow(2).mean().backward()
        for opt in (*ref_opts, *user):
            opt.step()
            opt.zero_grad()
        diffs.append(_max_diff(ours.module, ref.module))
    return {"diffs": diffs, "moved": _max_diff(ref.module, start), "refusals": refusals,
            "grads_none": all(p.grad is None for p in ours.parameters() if group_of(p) is not None)}


def _warmup_then_decay(step: int) -> float:
    return (step + 1) / 3 if step < 3 else 0.5 ** (step - 2)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def parity_case(rank, world_size, case, **options):
    """``parity`` of ``CASES[case]``, as a case of ``overlap_optim.testing.run_cases``."""
    return parity(rank, case, **options)


def bucket_count(rank, world_size):
    return _bucket_count(bucket_cap_mb=0.0002)


# The checks of tests/test_dense_hook.py, run in one spawned group and reported one by one.
CHECKS = {
    **{case: partial(parity_case, case=case) for case in CASES},
    "multi_bucket": partial(parity_case, case="three_lrs_two_classes", bucket_cap_mb=0.0002),
    "unannotated_bias": partial(parity_case, case="three_lrs_two_classes", unannotated_bias=True),
    "fp16": partial(parity_case, case="sgd_momentum", comm="fp16"),
    "bf16": partial(parity_case, case="sgd_momentum", comm="bf16"),
    "accumulate_3": partial(parity_case, case="adam", accumulate=3),
    "scheduled": partial(parity_case, case="three_lrs_two_classes", schedule=_warmup_then_decay, steps=6),
    "buckets_seen": bucket_count,
    "reannotated": reannotated,
}


def _bucket_count(bucket_cap_mb: float) -> int:
    """How many buckets one backward reduces at this cap (second iteration, after DDP's rebuild)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = []

    def counting(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    ddp = DDP(tower(), bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(None, counting)
    for step in range(2):
        calls.clear()
        ddp(_data(step, dist.get_rank())[0]).sum().backward()
    return len(calls)
