"""Tensor parallelism for the dense part: our in-backward layer-wise step on the placed pieces against
torch's optimizer stepping the full tensors after backward.

Two ranks (gloo, spawned, one thread each), one tensor-parallel mesh over both, the same batch of 32
on both. The model: two blocks of ``fc1`` (``ColwiseParallel``, width -> 4 x width) and ``fc2``
(``RowwiseParallel``, back to width). Weights with ``torch.optim.Adafactor`` (a second group: Muon),
biases AdamW:

- ``ours``: annotated, then ``parallelize_module``; each weight's piece steps in backward with its
  cross-shard form, the whole-tensor statistics summed in one all-reduce at the end of backward
  (Muon: each matrix gathered in it);
- ``full``: the same parallel model, and after backward torch's optimizer on full copies of the
  parameters: each gradient gathered whole (``full_tensor``), the full tensors stepped, each
  rank's piece copied back. Every rank then holds the whole optimizer state, as under DDP;
- ``ddp``: the unsharded model under DDP with our comm hook, each rank its own batch of 32: the
  optimizer-state bytes of data parallelism, for the 1/TP claim.

Each peer is timed in the same processes, alternating. All-reduces are counted over ``ours``' steps.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap_optim
from benchmarks._timing import on_ranks, time_peers

BLOCKS, BATCH, LR = 2, 32, 1e-3
PEERS = ("ours", "full", "ddp")


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def _model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block(width) for _ in range(BLOCKS)])


def _plan() -> dict:
    return {f"{i}.{name}": style for i in range(BLOCKS)
            for name, style in (("fc1", ColwiseParallel()), ("fc2", RowwiseParallel()))}


def _weights_and_biases(model: nn.Module) -> tuple[list, list]:
    params = list(model.parameters())
    return [p for p in params if p.dim() == 2], [p for p in params if p.dim() != 2]


def _optimizers(name: str) -> tuple:
    return (torch.optim.Muon, {"lr": LR}) if name == "muon" else (torch.optim.Adafactor, {"lr": LR})


def _state_bytes(states) -> int:
    total = 0
    for state in states:
        for value in state.values():
            value = value.to_local() if isinstance(value, DTensor) else value
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def _piece(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's piece of ``full``, placed as ``param`` is (one mesh dimension)."""
    (placement,) = param.placements
    if not isinstance(placement, Shard):
        return full
    return torch.chunk(full, param.device_mesh.size(), dim=placement.dim)[param.device_mesh.get_local_rank()]


def _build(peer: str, width: int, weights: str):
    """(step function, a function giving this rank's optimizer-state bytes)."""
    cls, kwargs = _optimizers(weights)
    model = _model(width)
    rank = dist.get_rank()
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(rank if peer == "ddp" else 0))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if peer == "full":
        parallelize_module(model, mesh, _plan())
        params = list(model.parameters())
        full = [p.full_tensor().detach().requires_grad_() for p in params]
        weight_full = [f for f in full if f.dim() == 2]
        optimizers = [cls(weight_full, **kwargs), torch.optim.AdamW([f for f in full if f.dim() != 2], lr=LR)]

        def step() -> None:
            model(x).square().mean().backward()
            for param, whole in zip(params, full):
                whole.grad = param.grad.full_tensor()
                param.grad = None
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for param, whole in zip(params, full):
                    param.to_local().copy_(_piece(whole, param))

        return step, lambda: _state_bytes(s for o in optimizers for s in o.state.values())
    weights_, biases = _weights_and_biases(model)
    overlap_optim.apply_optimizer_in_backward(cls, weights_, kwargs)
    overlap_optim.apply_optimizer_in_backward(torch.optim.AdamW, biases, {"lr": LR})
    if peer == "ours":
        wrapped = parallelize_module(model, mesh, _plan())
    else:
        wrapped = DDP(model)
        overlap_optim.register_optimizer_hook(wrapped)
    keyed = overlap_optim.get_optimizers(wrapped)
    return (lambda: wrapped(x).square().mean().backward()), (lambda: _state_bytes(keyed.state.values()))


@contextlib.contextmanager
def _counted_all_reduces():
    """The number of ``dist.all_reduce`` calls made inside, in a one-element list."""
    count, original = [0], dist.all_reduce

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield count
    finally:
        dist.all_reduce = original


def _time(rank: int, world_size: int, width: int, weights: str, warmup: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    built = {peer: _build(peer, width, weights) for peer in PEERS}
    timings = time_peers({peer: step for peer, (step, _) in built.items() if peer != "ddp"}, warmup, repeats)
    built["ddp"][0]()  # its state exists once it has stepped
    with _counted_all_reduces() as count:
        for _ in range(repeats):
            built["ours"][0]()
    return {"timings": timings, "state_bytes": {peer: state() for peer, (_, state) in built.items()},
            "all_reduces_per_step": count[0] / repeats}


def run(quick: bool) -> dict:
    """Measure; returns a JSON-able result with ratios."""
    width, muon_width = (32, 16) if quick else (512, 128)
    warmup, repeats = (1, 2) if quick else (3, 15)
    groups = {"adafactor": (width, repeats), "muon": (muon_width, 3 if quick else 7)}
    out, ratios = {}, {}
    for weights, (group_width, group_repeats) in groups.items():
        ranks = on_ranks(_time, group_width, weights, warmup, group_repeats, quick=quick, timeout=1200)
        timings = ranks[0]["timings"]
        state = {peer: max(r["state_bytes"][peer] for r in ranks) for peer in PEERS}
        out[weights] = {"width": group_width, "repeats": group_repeats, "timings": timings,
                        "state_bytes_per_rank": state, "all_reduces_per_step": ranks[0]["all_reduces_per_step"]}
        label = "Adafactor" if weights == "adafactor" else "Muon"
        ratios[f"{label} step time, full / ours (target >= 1)"] = timings["full"]["median_s"] / timings["ours"]["median_s"]
        about = "about 0.5: 1/TP" if weights == "muon" else "above 1/TP: factored"
        ratios[f"{label} optimizer-state bytes per rank, ours / ddp ({about})"] = state["ours"] / state["ddp"]
        ratios[f"{label} all-reduces per step, ours (target == 1)"] = ranks[0]["all_reduces_per_step"]
    params = sum(p.numel() for p in _model(width).parameters())
    return {
        "setup": {"ranks": 2, "tp": 2, "blocks": BLOCKS, "width": width, "parameters": params, "batch": BATCH,
                  "threads": 1},
        **out,
        "ratios": ratios,
    }
