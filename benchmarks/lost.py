"""What watching for torch's own ``fully_shard`` costs a training step (one process, no FSDP).

``overlap_optim.lost.watch_fully_shard`` is torch's global forward pre-hook, registered at the
first annotation: it refuses, at an FSDP module's first forward, annotated parameters that torch's
own ``fully_shard`` took. A global hook puts every module call of the process on the slower path
of ``Module.__call__``, FSDP or not. This measures that cost on two annotated models (Adam in
backward), each step a forward and a backward:

- ``tower``: a dense tower of 8 ``Linear`` layers 512 wide with ReLU, batch 512 (quick: 64 wide,
  batch 16): 17 module calls per forward, each doing real work;
- ``tiny``: 60 ``Linear`` layers 16 wide in their own ``Sequential`` with a ReLU, batch 4: 181
  module calls per forward, each doing almost nothing (the worst case).

Peers, alternating in one run: ``watched`` (the hook registered, as after any annotation) and
``unwatched`` (removed for the peer's steps).
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks._timing import time_peers
from overlap_optim import apply_optimizer_in_backward
from overlap_optim.lost import watch_fully_shard


def _tower(width: int) -> nn.Sequential:
    layers = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def _tiny() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(60)])


def _steps(model: nn.Module, x: torch.Tensor, steps: int, watched: bool):
    def run() -> None:
        if watched:
            watch_fully_shard.cache_clear()
            watch_fully_shard()
        else:
            watch_fully_shard().remove()
        for _ in range(steps):
            model(x).sum().backward()
    return run


def _module_calls(model: nn.Module, x: torch.Tensor) -> int:
    calls = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: calls.append(m))
    model(x)
    handle.remove()
    return len(calls)


def run(quick: bool) -> dict:
    """Measure; returns a JSON-able result with ratios."""
    torch.manual_seed(0)
    width, batch = (64, 16) if quick else (512, 512)
    steps, warmup, repeats = (2, 1, 3) if quick else (20, 3, 25)
    models = {"tower": (_tower(width), torch.randn(batch, width)), "tiny": (_tiny(), torch.randn(4, 16))}
    out, ratios = {}, {}
    for name, (model, x) in models.items():
        apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 1e-4})
        peers = {peer: _steps(model, x, steps, peer == "watched") for peer in ("unwatched", "watched")}
        timings = time_peers(peers, warmup, repeats)
        calls = _module_calls(model, x)
        per_call_us = (timings["watched"]["median_s"] - timings["unwatched"]["median_s"]) / steps / calls * 1e6
        out[name] = {"module_calls_per_step": calls, "steps_per_sample": steps, "timings": timings,
                     "extra_us_per_module_call": per_call_us}
        target = "(target <= 1.02)" if name == "tower" else "(worst case: no target)"
        ratios[f"{name} step time, watched / unwatched {target}"] = (
            timings["watched"]["median_s"] / timings["unwatched"]["median_s"])
    watch_fully_shard.cache_clear()
    watch_fully_shard()  # left as an annotation leaves it
    return {"setup": {"width": width, "batch": batch, "threads": torch.get_num_threads()}, **out, "ratios": ratios}
