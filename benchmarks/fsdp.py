"""FSDP2 for the dense part: our in-backward AdamW on sharded parameters against FSDP2 + torch's AdamW.

Two ranks (gloo, spawned, one thread each), an MLP of 5 square layers (2048 wide: 21M parameters;
quick: 256), each rank its own batch of 32:

- ``ours``: annotated with ``torch.optim.AdamW``, sharded by ``overlap_optim.fully_shard``: each
  FSDP group's shards step right after its reduce-scatter, gradients released;
- ``fsdp_adamw``: torch's ``fully_shard`` on the same layers and root, ``torch.optim.AdamW`` over
  the sharded parameters stepped after backward (torch's default kernel for DTensors), then
  ``zero_grad(set_to_none=True)``;
- ``ddp_ours``: the same MLP under DDP with our comm hook (``register_optimizer_hook``): every rank
  holds the whole optimizer state. Timed too, for reference.

Muon's cost under FSDP2, in a second group on a narrower MLP (256 wide; quick: 64): torch's
Newton-Schulz runs in bfloat16, about 0.26 s for one 256 x 256 matrix on one thread here, so a
2048-wide Muon step would take most of a minute. Weights ``torch.optim.Muon``, biases AdamW:

- ``fsdp_muon``: ``overlap_optim.fully_shard``; each weight's whole update is gathered at the end of
  backward (one all-reduce of every weight, float64) and every rank orthogonalises it;
- ``ddp_muon``: DDP with our comm hook, the gradient all-reduced, every rank orthogonalises;
- ``ours`` and ``ddp_ours`` (AdamW) at the same width, so that Muon's own cost on each path (its step
  less AdamW's) can be compared: the gather is what FSDP2 adds to it.

Each peer is timed in the same processes, alternating. Optimizer-state bytes are each rank's own
(local shards of DTensor state). Peak RSS is measured per peer in a group of its own.
"""

from __future__ import annotations


import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap_optim
from benchmarks._timing import on_ranks, own_peak_rss_kib, peak_rss_kib, time_peers

LAYERS, BATCH, LR = 5, 32, 1e-3
PEERS = ("ours", "fsdp_adamw", "ddp_ours")
MUON_PEERS = ("fsdp_muon", "ddp_muon", "ours", "ddp_ours")


def _mlp(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(width, width), nn.ReLU())])


def _state_bytes(states) -> int:
    total = 0
    for state in states:
        for value in state.values():
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def _build(peer: str, width: int, world_size: int):
    """(step function, a function giving this rank's optimizer-state bytes)."""
    model = _mlp(width)
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    if peer == "fsdp_adamw":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

        def step() -> None:
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step, lambda: _state_bytes(optimizer.state.values())
    if peer.endswith("muon"):
        overlap_optim.apply_optimizer_in_backward(torch.optim.Muon, [p for p in model.parameters() if p.dim() == 2],
                                                  {"lr": LR})
        overlap_optim.apply_optimizer_in_backward(torch.optim.AdamW, [p for p in model.parameters() if p.dim() == 1],
                                                  {"lr": LR})
    else:
        overlap_optim.apply_optimizer_in_backward(torch.optim.AdamW, model.parameters(), {"lr": LR})
    if peer in ("ours", "fsdp_muon"):
        overlap_optim.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
        wrapped = model
    else:
        wrapped = DDP(model)
        overlap_optim.register_optimizer_hook(wrapped)
    keyed = overlap_optim.get_optimizers(wrapped)
    return (lambda: wrapped(x).square().mean().backward()), (lambda: _state_bytes(keyed.state.values()))


def _time(rank: int, world_size: int, peers: tuple[str, ...], width: int, warmup: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    built = {peer: _build(peer, width, world_size) for peer in peers}
    timings = time_peers({peer: step for peer, (step, _) in built.items()}, warmup, repeats)
    return {"timings": timings, "state_bytes": {peer: state() for peer, (_, state) in built.items()}}


def _memory(rank: int, world_size: int, peer: str, width: int, steps: int) -> int:
    torch.set_num_threads(1)
    step, _ = _build(peer, width, world_size)
    for _ in range(steps):
        step()
    return own_peak_rss_kib()


def run(quick: bool) -> dict:
    """Measure; returns a JSON-able result with ratios."""
    width = 256 if quick else 2048
    warmup, repeats = (1, 3) if quick else (3, 15)
    ranks = on_ranks(_time, PEERS, width, warmup, repeats, quick=quick, timeout=1200)
    timings = ranks[0]["timings"]
    muon_width, muon_repeats = (64, 3) if quick else (256, 5)
    muon = on_ranks(_time, MUON_PEERS, muon_width, 1, muon_repeats, quick=quick, timeout=1200)
    muon_timings = muon[0]["timings"]
    muon_state = {peer: max(r["state_bytes"][peer] for r in muon) for peer in MUON_PEERS}
    muon_s = {peer: muon_timings[peer]["median_s"] for peer in MUON_PEERS}
    state = {peer: max(r["state_bytes"][peer] for r in ranks) for peer in PEERS}
    memory = peak_rss_kib(_memory, list(PEERS), width, 3, quick=quick)
    ours = timings["ours"]["median_s"]
    params = sum(p.numel() for p in _mlp(width).parameters())
    return {
        "setup": {"ranks": 2, "layers": LAYERS, "width": width, "parameters": params, "batch_per_rank": BATCH,
                  "optimizer": "AdamW", "threads": 1, "repeats": repeats},
        "timings": timings,
        "state_bytes_per_rank": state,
        "muon": {"width": muon_width, "repeats": muon_repeats, "timings": muon_timings,
                 "state_bytes_per_rank": muon_state,
                 "gathered_floats_per_step": LAYERS * muon_width * muon_width},
        "peak_rss_kib": memory,
        "ratios": {
            "step time, fsdp_adamw / ours (target >= 1)": timings["fsdp_adamw"]["median_s"] / ours,
            "step time, ddp_ours / ours": timings["ddp_ours"]["median_s"] / ours,
            "optimizer-state bytes per rank, ours / ddp_ours (about 0.5)": state["ours"] / state["ddp_ours"],
            "optimizer-state bytes per rank, ours / fsdp_adamw": state["ours"] / state["fsdp_adamw"],
            "peak RSS, ours / fsdp_adamw": memory["ours"] / memory["fsdp_adamw"],
            "peak RSS, ours / ddp_ours": memory["ours"] / memory["ddp_ours"],
            "Muon step time, fsdp_muon / ddp_muon": muon_s["fsdp_muon"] / muon_s["ddp_muon"],
            "Muon's cost over AdamW, FSDP2 / DDP (the gather's share)":
                (muon_s["fsdp_muon"] - muon_s["ours"]) / (muon_s["ddp_muon"] - muon_s["ddp_ours"]),
            "Muon optimizer-state bytes per rank, fsdp_muon / ddp_muon":
                muon_state["fsdp_muon"] / muon_state["ddp_muon"],
        },
    }
