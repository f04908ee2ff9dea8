"""Dense in-backward optimizers: our comm hook against torch's algorithm and plain DDP (2 ranks, gloo).

Model: an MLP tower with 300 parameter tensors (150 Linear layers, widths cycling
through 64/96/128), Adam with three learning rates (one per third of the layers).

Peers, same process group, alternating in one run:

- ``ours``: DDP + ``overlap_optim.register_optimizer_hook``: all-reduce, then one
  foreach Adam per compatible set in each bucket, gradients released after backward;
- ``torch_in_backward``: torch's algorithm for DDP in-backward optimizers
  (``_apply_optim_in_backward_hook``): all-reduce, divide, then each parameter's own
  ``optimizer.step()`` in a Python loop, gradients set to None at the end of backward.
  Its own code crashes on CPU (``torch.accelerator.current_stream()``), so the
  benchmark reproduces that algorithm without the stream handling;
- ``ddp_foreach``: plain DDP, then ``torch.optim.Adam(foreach=True)`` over three
  param groups after backward;
- ``ours_fused`` and ``ddp_fused``: the same two with ``fused=True``, torch's one-pass
  Adam kernel. Ours then steps each annotation group's share of a bucket in one
  ``torch.optim`` call, as torch steps a param group.

Peak RSS is measured per peer in a group of its own (``VmHWM`` of each rank).
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations as objects.

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.optim.apply_optimizer_in_backward import _apply_optimizer_in_backward
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks._timing import on_ranks, own_peak_rss_kib, peak_rss_kib, time_peers
from overlap_optim import apply_optimizer_in_backward, register_optimizer_hook

LRS = (1e-3, 3e-4, 1e-4)
WIDTHS = (64, 96, 128)


def _tower(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods += [nn.Linear(WIDTHS[i % 3], WIDTHS[(i + 1) % 3]), nn.ReLU()]
    return nn.Sequential(*mods)


def _thirds(model: nn.Sequential) -> list[list[torch.Tensor]]:
    linears = [m for m in model if isinstance(m, nn.Linear)]
    third = -(-len(linears) // 3)
    return [[p for m in linears[i * third : (i + 1) * third] for p in m.parameters()] for i in range(3)]


def _ours(layers: int, **flags: bool) -> DDP:
    model = _tower(layers)
    for params, lr in zip(_thirds(model), LRS):
        apply_optimizer_in_backward(torch.optim.Adam, params, {"lr": lr, **flags})
    ddp = DDP(model)
    register_optimizer_hook(ddp)
    return ddp


def _torch_in_backward(layers: int) -> DDP:
    model = _tower(layers)
    for params, lr in zip(_thirds(model), LRS):
        _apply_optimizer_in_backward(torch.optim.Adam, params, {"lr": lr}, register_hook=False)
    ddp = DDP(model)
    ddp._lazy_init_ran = True  # keep DDP from installing its own (CPU-crashing) hook
    ddp.register_comm_hook(ddp, _torch_algorithm_hook)
    ddp.reducer._set_optimizer_in_backward()
    return ddp


def _torch_algorithm_hook(ddp: DDP, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut = ddp.reducer._run_allreduce_hook(bucket)
    fut.wait()
    bucket.buffer().div_(dist.get_world_size())
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        p.grad = g
        for optimizer in p._in_backward_optimizers:
            optimizer.step()
    if not getattr(ddp, "_bench_release_queued", False):
        ddp._bench_release_queued = True

        def release() -> None:
            for param in ddp.module.parameters():
                param.grad = None
            ddp._bench_release_queued = False

        Variable._execution_engine.queue_callback(release)
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _ddp_plain(layers: int, **flags: bool):
    model = _tower(layers)
    optimizer = torch.optim.Adam([{"params": p, "lr": lr} for p, lr in zip(_thirds(model), LRS)], **flags)
    return DDP(model), optimizer


PEERS = ("ours", "torch_in_backward", "ddp_foreach", "ours_fused", "ddp_fused")
# Forward and backward under plain DDP with no update at all: what every peer pays anyway.
BASELINE = "ddp_no_update"


def _steps(layers: int, batch: int, rank: int, peers=PEERS) -> dict:
    """One step function per peer, each over its own copy of the model."""
    x = torch.randn(batch, WIDTHS[0], generator=torch.Generator().manual_seed(rank))

    def in_backward(ddp: DDP):
        return lambda: ddp(x).square().mean().backward()

    def plain_step(**flags: bool):
        plain, optimizer = _ddp_plain(layers, **flags)

        def step() -> None:
            plain(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    build = {
        BASELINE: lambda: in_backward(DDP(_tower(layers))),
        "ours": lambda: in_backward(_ours(layers)),
        "torch_in_backward": lambda: in_backward(_torch_in_backward(layers)),
        "ddp_foreach": lambda: plain_step(foreach=True),
        "ours_fused": lambda: in_backward(_ours(layers, fused=True)),
        "ddp_fused": lambda: plain_step(fused=True),
    }
    return {peer: build[peer]() for peer in peers}


def _time(rank: int, world_size: int, layers: int, batch: int, warmup: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    return time_peers(_steps(layers, batch, rank, peers=(*PEERS, BASELINE)), warmup, repeats)


def _memory(rank: int, world_size: int, peer: str, layers: int, batch: int, steps: int) -> int:
    torch.set_num_threads(1)
    step = _steps(layers, batch, rank, peers=(peer,))[peer]
    for _ in range(steps):
        step()
    return own_peak_rss_kib()


def run(quick: bool) -> dict:
    """Time at a small batch (optimizer cost dominates) and a large one (compute dominates)."""
    layers, batches = (6, (16,)) if quick else (150, (16, 256))
    warmup, repeats = (1, 3) if quick else (5, 60)
    timings, ratios = {}, {}
    for batch in batches:
        timed = on_ranks(_time, layers, batch, warmup, repeats, quick=quick, timeout=900)[0]
        ours = timed["ours"]["median_s"]
        timings.update({f"{peer} (batch {batch})": t for peer, t in timed.items()})
        ratios[f"torch_in_backward / ours, batch {batch} (target >= 2)"] = timed["torch_in_backward"]["median_s"] / ours
        ratios[f"ddp_foreach / ours, batch {batch} (target >= 1)"] = timed["ddp_foreach"]["median_s"] / ours
        best = min(timed["ddp_fused"]["median_s"], timed["ddp_foreach"]["median_s"])
        ratios[f"best of (ddp_fused, ddp_foreach) / ours (default), batch {batch} (target >= 1)"] = best / ours
        ratios[f"ddp_fused / ours_fused, batch {batch} (target >= 1)"] = (
            timed["ddp_fused"]["median_s"] / timed["ours_fused"]["median_s"])
        ratios[f"ddp_foreach / ours_fused, batch {batch}"] = timed["ddp_foreach"]["median_s"] / timed["ours_fused"]["median_s"]
        base = timed[BASELINE]["median_s"]
        ratios[f"update cost (step - {BASELINE}): torch_in_backward / ours, batch {batch}"] = (
            timed["torch_in_backward"]["median_s"] - base) / max(ours - base, 1e-9)
    memory = peak_rss_kib(_memory, list(PEERS[:3]), layers, batches[-1], 3 if quick else 10, quick=quick)
    ratios["peak RSS ours / torch_in_backward"] = memory["ours"] / memory["torch_in_backward"]
    ratios["peak RSS ours / ddp_foreach"] = memory["ours"] / memory["ddp_foreach"]
    return {
        "setup": {"parameter_tensors": sum(1 for _ in _tower(layers).parameters()), "layers": layers,
                  "batches_per_rank": list(batches), "ranks": 2, "learning_rates": list(LRS), "repeats": repeats},
        "timings": timings,
        "ratios": ratios,
        "peak_rss_kib": memory,
    }
