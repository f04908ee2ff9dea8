"""Rank bodies for the layer-wise optimizer tests (spawned; not collected by pytest)."""

from __future__ import annotations

import copy

import torch
from pytorch_optimizer import LARS, GaLore, Lamb
from torch.nn.parallel import DistributedDataParallel

import overlap_optim

GALORE_OPTIONS = {"rank": 2, "update_proj_gap": 2, "scale": 0.25, "projection_type": "std"}


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 1))


def _split(model):
    weights = [p for p in model.parameters() if p.dim() == 2]
    return weights, [p for p in model.parameters() if p.dim() != 2]


# name -> (annotate ours, build the reference optimizers as a user would)
def _muon_adam(model, ours):
    weights, biases = _split(model)
    if ours:
        overlap_optim.apply_optimizer_in_backward(torch.optim.Muon, weights, {"lr": 0.05})
        overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, biases, {"lr": 0.01})
        return []
    return [torch.optim.Muon(weights, lr=0.05), torch.optim.Adam(biases, lr=0.01)]


def _single(cls, kwargs, options=None):
    def annotate(model, ours):
        if ours:
            overlap_optim.apply_optimizer_in_backward(cls, model.parameters(), kwargs, group_options=options)
            return []
        return [cls([{"params": list(model.parameters()), **(options or {})}], **kwargs)]
    return annotate


DENSE_CASES = {
    "muon+adam": _muon_adam,
    "adafactor": _single(torch.optim.Adafactor, {"lr": 0.05}),
    "lamb": _single(Lamb, {"lr": 0.02, "weight_decay": 0.01}),
    "lars": _single(LARS, {"lr": 0.5, "momentum": 0.9, "trust_coefficient": 0.02}),
    "galore": _single(GaLore, {"lr": 0.02}, GALORE_OPTIONS),
}


def dense_layerwise(rank, world_size, steps=4):
    """Each case through our DDP hook against the reference on the global batch, every step:
    {case: how far the reference moved}."""
    moved = {}
    for name, annotate in DENSE_CASES.items():
        model = _mlp()
        reference = copy.deepcopy(model)
        annotate(model, ours=True)
        ref_opts = annotate(reference, ours=False)
        ddp = DistributedDataParallel(model)
        overlap_optim.register_optimizer_hook(ddp)
        start = [p.detach().clone() for p in reference.parameters()]
        for step in range(steps):
            generator = torch.Generator().manual_seed(step)
            inputs = [torch.randn(4, 6, generator=generator) for _ in range(world_size)]
            ddp(inputs[rank]).pow(2).mean().backward()
            reference(torch.cat(inputs)).pow(2).mean().backward()
            for opt in ref_opts:
                opt.step()
                opt.zero_grad()
            for (n, p), q in zip(model.named_parameters(), reference.parameters()):
                diff = (p.detach() - q.detach()).abs().max().item()
                assert diff <= 1e-5, f"{name}, step {step}, {n}: {diff:.3g} from the reference"
        moved[name] = min((q.detach() - s).abs().max().item() for q, s in zip(reference.parameters(), start))
    return moved
