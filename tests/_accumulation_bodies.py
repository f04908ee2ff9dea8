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


def ddp_windows(rank, world_size, k, clip=False, windows=3, mutate=False, forward_before=False):
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
        return _train(ours, reference, ref_opts, k, windows, world_size, rank, clipping if clip else None, bound,
                      forward_before)
    # a no_step that neither holds DDP back nor the hook's updates
    from overlap_optim import comm_hooks
    saved = comm_hooks.window_of_params, DDP.no_sync
    comm_hooks.window_of_params, DDP.no_sync = (lambda *params: None), (lambda self: contextlib.nullcontext())
    try:
        return _train(ours, reference, ref_opts, k, windows, world_size, rank, None, None)
    finally:
        comm_hooks.window_of_params, DDP.no_sync = saved


def _train(ours, reference, ref_opts, k, windows, world_size, rank, clipping, bound, forward_before=False):
    opt = get_optimizers(ours)
    start = copy.deepcopy(reference)
    diffs, norms = [], []
    for window in range(windows):
        for micro in range(k - 1):
            if forward_before:  # the forward before the block (DDP prepares its all-reduce), backward inside
                loss = _loss(ours, _micro(window, micro, rank), k)
                with no_step(ours):
                    loss.backward()
                continue
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


# -- sharded tables: one DMP model with every kind of kernel (the model of _clipping_bodies) --


def _third_batch(names, generator, third, batch=4):
    """Per feature and sample 1-3 ids, all from one third of the rows (``third`` 0, 1 or 2)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from _models import ROWS

    low, high = third * ROWS // 3, (third + 1) * ROWS // 3
    lengths, values = [], []
    for _ in names:
        for _ in range(batch):
            ids = torch.randint(low, high, (int(torch.randint(1, 4, (1,), generator=generator)),), generator=generator)
            lengths.append(ids.numel())
            values.append(ids)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{n}" for n in names], values=torch.cat(values), lengths=torch.tensor(lengths))
    return kjt, torch.randn(batch, generator=generator)


def tables_windows(rank, world_size, k, clip=False, thirds=False, windows=2, mutate=False):
    """Windows of k micro-batches on the model of ``_clipping_bodies`` (fused Adagrad row-wise, fused
    SGD column-wise, fallback Adam lazy row-wise, fallback RMSprop dense column-wise, cross-shard
    Adafactor row-wise, a data-parallel Adam table, the MLP under the DDP hook, a user SGD layer),
    against one process: k backward() calls on the global micro-batches, then one step.

    ``thirds``: micro-batch m touches only rows of third m (the lazy reference is SparseAdam on
    the window's coalesced gradient). ``mutate``: each kernel updates at every micro-batch."""
    from _clipping_bodies import NAMES, _build, _largest_difference, _reference_clip
    from _models import concat_batches, covering_batch, loss_of
    from _sharded_parity import compare

    def parts(w, m):
        generator = lambda r: torch.Generator().manual_seed(100 * w + 10 * m + r)  # noqa: E731
        if thirds:
            return [_third_batch(NAMES, generator(r), m % 3) for r in range(world_size)]
        return [covering_batch(NAMES, generator(r), cover=True) for r in range(world_size)]

    lazy = thirds
    how = "norm" if clip else None
    dmp, reference, ref_opts, clipping, bound = _build(rank, world_size, "everything", how, 2.0, parts(0, 0), lazy)
    plan = None
    if mutate:  # the kernels never see no_step
        import sharders
        from overlap_optim.record import module_record
        plan = sharders.plan_of(dmp.module.ebc)
        object.__setattr__(plan, "accumulate", contextlib.nullcontext)
        object.__setattr__(plan, "window_members", list)
        found = module_record(dmp.module.ebc)  # a record blind to the model's window
        found.__class__ = type("Blind", (type(found),), {"window": property(lambda s: None, lambda s, v: None)})
    opt = get_optimizers(dmp)
    ours_user = torch.optim.SGD([p for n, p in dmp.named_parameters() if n.startswith("dense.2.")], lr=0.1)
    ref_user = torch.optim.SGD(reference.dense[2].parameters(), lr=0.1)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    norms, worst = [], 0.0
    for w in range(windows):
        for m in range(k):
            context = no_step(dmp) if m < k - 1 else contextlib.nullcontext()
            with context:
                (loss_of(dmp, parts(w, m)[rank]) / k).backward()
        opt.step()
        ours_user.step()
        ours_user.zero_grad()
        for m in range(k):
            (loss_of(reference, concat_batches(parts(w, m))) / k).backward()
        if clip:
            norm = _reference_clip(reference, "everything", "norm", bound, 2.0, lazy)
            norms.append((norm.item(), clipping.total_norm.item()))
        elif lazy:
            weight = reference.ebc.embedding_bags["adam"].weight
            weight.grad = weight.grad.to_sparse(sparse_dim=1)
        for o in ref_opts + [ref_user]:
            o.step()
        reference.zero_grad()
        if mutate:
            worst = max(worst, _largest_difference(dmp, reference))
        else:
            compare(dmp, reference, NAMES, w, atol=2e-5)
    moved = {n: (p.detach() - start[n]).abs().max().item() for n, p in reference.named_parameters()}
    kinds = {n: t.kind.value for n, t in __import__("sharders").plan_of(dmp.module.ebc).tables.items()}
    return {"moved": moved, "norms": norms, "bound": bound, "kinds": kinds, "worst": worst}


def qsr_windows(rank, world_size, k=2, windows=4):
    """Local SGD (QSR, period 3) under no_step: its step count after ``windows`` windows of k
    micro-batches, and the largest difference between the ranks' weights (0 right after an
    averaging, which a period-3 schedule makes at its 3rd step)."""
    model = _tower()
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.05})
    sync = overlap_optim.QSR(alpha=0.0, base_period=3)
    ours = DDP(model)
    register_optimizer_hook(ours, local_sgd=sync)
    opt = get_optimizers(ours)
    spread_after = []
    for window in range(windows):
        for micro in range(k - 1):
            with no_step(ours):
                _loss(ours, _micro(window, micro, rank), k).backward()
        _loss(ours, _micro(window, k - 1, rank), k).backward()
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(world_size)]
        dist.all_gather(gathered, flat)
        spread_after.append((gathered[0] - gathered[1]).abs().max().item())
    return {"steps": sync.step, "spread_after": spread_after}
