"""Local SGD (QSR) for the dense part: step time and all-reduce bytes against synchronous training.

Two ranks (gloo, spawned), one MLP each way, alternating in every rank: ``sync`` (our DDP hook, an
all-reduce per bucket per step) and ``qsr`` (the same hook with ``local_sgd=QSR(alpha=0,
base_period=H)``: no all-reduce on local steps, one flattened all-reduce of the parameters every H
steps). Gloo on one machine makes communication cheap, so the bytes matter as much as the times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap_optim
from benchmarks._timing import on_ranks, time_peers

WIDTH, LAYERS, BATCH, PERIOD = 256, 8, 64, 8


def _model(local_sgd):
    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))
    overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 1e-3})
    ddp = DDP(model)
    overlap_optim.register_optimizer_hook(ddp, local_sgd=local_sgd)
    return ddp


def _bytes_per_step(step, steps):
    sizes = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        for _ in range(steps):
            step()
    finally:
        dist.all_reduce = original
    return sum(sizes) / steps, len(sizes) / steps


def _rank(rank, world_size, warmup, repeats):
    torch.set_num_threads(1)
    x = torch.randn(BATCH, WIDTH)
    models = {"sync": _model(None), "qsr": _model(overlap_optim.QSR(alpha=0.0, base_period=PERIOD))}
    steps = {name: (lambda m=m: m(x).pow(2).mean().backward()) for name, m in models.items()}
    timings = time_peers(steps, warmup, repeats)
    traffic = {name: _bytes_per_step(step, PERIOD * 2) for name, step in steps.items()}
    return {"timings": timings, "traffic": traffic}


def run(quick: bool) -> dict:
    """Measure; returns a JSON-able result with ratios."""
    warmup, repeats = (PERIOD, PERIOD) if quick else (2 * PERIOD, 10 * PERIOD)
    result = on_ranks(_rank, warmup, repeats, quick=quick, timeout=600)[0]
    timings, traffic = result["timings"], result["traffic"]
    return {
        "setup": {"ranks": 2, "width": WIDTH, "layers": LAYERS, "batch": BATCH, "period": PERIOD,
                  "optimizer": "Adam", "repeats": repeats},
        "timings": timings,
        "traffic": {name: {"bytes_per_step": b, "all_reduces_per_step": n} for name, (b, n) in traffic.items()},
        "ratios": {
            "step time, sync / qsr": timings["sync"]["median_s"] / timings["qsr"]["median_s"],
            "dense all-reduce bytes per step, sync / qsr (target >= 4)": traffic["sync"][0] / traffic["qsr"][0],
        },
    }
