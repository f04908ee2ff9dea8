"""Rank bodies for the 2-rank accumulation tests (spawned; not collected by pytest).

Dense part: DDP + ``register_optimizer_hook``; the reference is one process on the global batch:
k backward() calls on the global micro-batches (each loss divided by k), then one torch.optim step.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap_optim
from overlap_optim import apply_optimizer_in_backward, get_optimizers, no_step, register_optimizer_hook


def _tower(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _micro(window, micro, rank):
    generator = torch.Generator().manual_seed(1000 * window + 10 * rank + micro)
    return torch.randn(4, 6, generator=generator), torch.randn(4, 1, generator=generator)


def _global(window, micro, world_size):
    parts = [_micro(window, micro, r) for r in range(world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _loss(model, batch, k):
    x, y = batch
    return (model(x) - y).pow(2).mean() / k


def ddp_windows(rank, world_size, k, clip=False, windows=3, mutate=False):
    """Ours (DDP + our hook, ``no_step`` for all but the last micro-batch of each window)
    against one process on the global batch; the largest difference after each window."""
    model = _tower()
    reference = copy.deepcopy(model)
    apply_optimizer_in_backward(torch.optim.Adam, model[0].parameters(), {"lr": 0.05})
    apply_optimizer_in_backward(torch.optim.SGD, model[2].parameters(), {"lr": 0.1, "momentum": 0.9})
    ref_opts = [torch.optim.Adam(reference[0].parameters(), lr=0.05),
                torch.optim.SGD(reference[2].parameters(), lr=0.1, momentum=0.9)]
    bound = None
    if clip:
        probe = copy.deepcopy(reference)
        for micro in range(k):
            _loss(probe, _global(0, micro, world_size), k).backward()
        bound = 0.3 * torch.nn.utils.get_total_norm([p.grad for p in probe.parameters()]).item()
        clipping = overlap_optim.apply_gradient_clipping(model.parameters(), max_norm=bound)
    ours = DDP(model)
    register_optimizer_hook(ours)
    if not mutate:
        return _train(ours, reference, ref_opts, k, windows, world_size, rank, clipping if clip else None, bound)
    # a no_step that neither holds DDP back nor the hook's updates
    from overlap_optim import comm_hooks
    saved = comm_hooks.accumulating, DDP.no_sync
    comm_hooks.accumulating, DDP.no_sync = (lambda param: False), (lambda self: contextlib.nullcontext())
    try:
        return _train(ours, reference, ref_opts, k, windows, world_size, rank, None, None)
    finally:
        comm_hooks.accumulating, DDP.no_sync = saved


def _train(ours, reference, ref_opts, k, windows, world_size, rank, clipping, bound):
    opt = get_optimizers(ours)
    start = copy.deepcopy(reference)
    diffs, norms = [], []
    for window in range(windows):
        for micro in range(k - 1):
            with no_step(ours):
                _loss(ours, _micro(window, micro, rank), k).backward()
        _loss(ours, _micro(window, k - 1, rank), k).backward()
        opt.step()
        for micro in range(k):
            _loss(reference, _global(window, micro, world_size), k).backward()
        if clipping is not None:
            norms.append((torch.nn.utils.clip_grad_norm_(reference.parameters(), bound).item(),
                          clipping.total_norm.item()))
        for o in ref_opts:
            o.step()
            o.zero_grad()
        diffs.append(max((p - q).abs().max().item() for p, q in zip(ours.module.parameters(), reference.parameters())))
    moved = min((p - q).abs().max().item() for p, q in zip(reference.parameters(), start.parameters()))
    return {"diffs": diffs, "moved": moved, "norms": norms, "bound": bound}


def undeclared(rank, world_size):
    """The usual accumulation loop without no_step: backward, backward, step(). Returns where it
    was stopped: (window, micro-batch, message)."""
    model = _tower()
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.05})
    ours = DDP(model)
    register_optimizer_hook(ours)
    opt = get_optimizers(ours)
    for window in range(3):
        for micro in range(2):
            try:
                _loss(ours, _micro(window, micro, rank), 2).backward()
            except RuntimeError as err:
                return window, micro, str(err)
        opt.step()
    return None


def forward_outside(rank, world_size):
    """The micro-batch's forward outside no_step, its backward inside: refused (DDP prepared its
    all-reduce at that forward)."""
    model = _tower()
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.05})
    ours = DDP(model)
    register_optimizer_hook(ours)
    loss = _loss(ours, _micro(0, 0, rank), 2)
    try:
        with no_step(ours):
            loss.backward()
    except RuntimeError as err:
        return str(err)
    return "no error"
