"""Rank bodies for the virtual-group tests (spawned; not collected by pytest)."""

from __future__ import annotations

import collections
import contextlib
import copy

import torch
from torch.nn.parallel import DistributedDataParallel

import overlap_optim
from _models import concat_batches, covering_batch, loss_of, without_compiled_operators
from _sharded_parity import build, compare
from sharders.describe import kernel_rows

LAYERS = 48


def _layer_lambda(i):
    """Group i's schedule: its own warm-up length and decay."""
    return lambda step: min(1.0, (step + 1) / (1 + i % 4)) * (0.9 ** (step * (i % 3)))


def dense_per_layer(rank, world_size, steps=4):
    """48 layers, one Adam param group each (per-layer lr) and one LambdaLR lambda each, through
    our DDP hook, against torch.optim.Adam with 48 param groups on the global batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(LAYERS)])
    reference = copy.deepcopy(model)
    lrs = [0.01 * (1 + i / LAYERS) for i in range(LAYERS)]
    for layer, lr in zip(model, lrs):
        overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, layer.parameters(), {"lr": lr, "weight_decay": 0.01})
    ddp = DistributedDataParallel(model)
    overlap_optim.register_optimizer_hook(ddp)
    ours = overlap_optim.get_optimizers(ddp)
    assert [g["lr"] for g in ours.param_groups] == lrs
    ref_opt = torch.optim.Adam([{"params": layer.parameters(), "lr": lr} for layer, lr in zip(reference, lrs)],
                               weight_decay=0.01)
    lambdas = [_layer_lambda(i) for i in range(LAYERS)]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambdas) for o in (ours, ref_opt)]
    start = [p.detach().clone() for p in reference.parameters()]
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        inputs = [torch.randn(3, 6, generator=generator) for _ in range(world_size)]
        ddp(inputs[rank]).pow(2).mean().backward()
        reference(torch.cat(inputs)).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ours.step()
        for schedule in schedules:
            schedule.step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            diff = (p.detach() - q.detach()).abs().max().item()
            assert diff <= 1e-5, f"step {step}, {name}: {diff:.3g} from torch.optim"
    return min((q.detach() - s).abs().max().item() for q, s in zip(reference.parameters(), start))


def fallback_tables(rank, world_size, sharding_type, steps=4, step_bytes=None, one_pass=True):
    """6 Adam tables, 6 lrs and one LambdaLR lambda each, on batches that touch every row (the
    reference is dense torch.optim; the lazy rule is tested in test_lazy_reference.py):
    (how far each reference table moved, this rank's describe() rows, the tables of each
    ``step_tables`` call of the fallback kernel, whether they stepped in one compiled pass). ``step_bytes``: the
    kernel's chunk size (``sharders.fallback.STEP_BYTES``); ``one_pass=False``: as where the
    extension was not built (the tables of a chunk then share one multi-tensor update)."""
    import sharders.fallback

    kept, original = sharders.fallback.STEP_BYTES, sharders.fallback.step_tables
    chunks, passes = [], set()

    def recording(updates):
        chunks.append(len(updates))
        passes.update(table.one_pass for table, _, _ in updates)
        return original(updates)

    sharders.fallback.step_tables = recording
    if step_bytes is not None:
        sharders.fallback.STEP_BYTES = step_bytes
    try:
        with contextlib.nullcontext() if one_pass else without_compiled_operators():
            return {**_fallback_tables(rank, world_size, sharding_type, steps), "chunks": chunks, "one_pass": passes}
    finally:
        sharders.fallback.STEP_BYTES, sharders.fallback.step_tables = kept, original


def _fallback_tables(rank, world_size, sharding_type, steps):
    names = [f"t{i}" for i in range(6)]
    settings = [(torch.optim.Adam, {"lr": 0.02 * (i + 1), "weight_decay": 0.01 * i}) for i in range(6)]
    dmp, reference, ref_opts = build(names, settings, sharding_type, world_size)
    lambdas = [_layer_lambda(i) for i in range(6)]
    keyed = overlap_optim.get_optimizers(dmp)
    schedules = [torch.optim.lr_scheduler.LambdaLR(keyed, lambdas)]
    schedules += [torch.optim.lr_scheduler.LambdaLR(o, f) for o, f in zip(ref_opts, lambdas)]
    start = {n: reference.ebc.embedding_bags[n].weight.detach().clone() for n in names}
    for step in range(steps):
        generator = torch.Generator().manual_seed(700 + step)
        parts = [covering_batch(names, generator) for _ in range(world_size)]
        loss_of(dmp, parts[rank]).backward()
        loss_of(reference, concat_batches(parts)).backward()
        keyed.step()
        for opt in ref_opts:
            opt.step()
        for schedule in schedules:
            schedule.step()
        reference.zero_grad()
        compare(dmp, reference, names, step)
    moved = {n: (reference.ebc.embedding_bags[n].weight.detach() - start[n]).abs().max().item() for n in names}
    return {"moved": moved, "rows": kernel_rows(dmp)}


def optimizer_ops_per_bucket(rank, world_size):
    """{settings: Counter of optimizer ops (foreach and fused) in one backward} for 24 layers in one
    bucket, Adam at 1 and at 24 distinct learning rates, counted by the torch profiler on every thread
    (the comm hook's update runs on the thread that completes the all-reduce)."""
    counts = {}
    for settings in (1, 24):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(24)])
        for i in range(settings):
            params = [p for layer in list(model)[i::settings] for p in layer.parameters()]
            overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, params, {"lr": 1e-3 * (i + 1)})
        ddp = DistributedDataParallel(model, bucket_cap_mb=100)  # one bucket
        overlap_optim.register_optimizer_hook(ddp)
        x = torch.randn(4, 8)
        ddp(x).sum().backward()  # the first step creates the state
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config) as prof:
            ddp(x).sum().backward()
        counts[settings] = collections.Counter(
            e.name for e in prof.events() if e.name.startswith(("aten::_foreach_", "aten::_fused_adam"))
        )
    return counts
