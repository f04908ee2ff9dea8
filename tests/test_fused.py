"""The default dense path runs torch's fused CPU kernels: one call per distinct float setting,
exact against torch.optim's default (single-tensor) path within the parity tolerance, and the
multi-tensor update where no fused kernel applies (float64, other classes)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import overlap_optim
from overlap_optim import apply_optimizer_in_backward

CONFIGS = {
    "adam": (torch.optim.Adam, {"eps": 1e-6, "weight_decay": 0.01}, "_fused_adam_"),
    "adam_amsgrad_maximize": (torch.optim.Adam, {"amsgrad": True, "maximize": True}, "_fused_adam_"),
    "adamw": (torch.optim.AdamW, {"weight_decay": 0.1}, "_fused_adamw_"),
    "sgd": (torch.optim.SGD, {}, "_fused_sgd_"),
    "sgd_momentum": (torch.optim.SGD, {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}, "_fused_sgd_"),
    "sgd_nesterov": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, "_fused_sgd_"),
    "adagrad": (torch.optim.Adagrad, {"lr_decay": 0.01, "initial_accumulator_value": 0.1}, "_fused_adagrad_"),
    "rmsprop": (torch.optim.RMSprop, {"momentum": 0.5}, None),  # no fused kernel: the multi-tensor update
}
LRS = (0.01, 0.02, 0.03)  # three settings over six layers


def _train(name, dtype, monkeypatch):
    """Six layers, two per learning rate, under the DDP hook; the reference is torch.optim's default
    path with one param group per layer. Returns (largest difference over the steps, calls of torch's
    fused kernel per step, how far the reference moved)."""
    cls, kwargs, kernel = CONFIGS[name]
    counted = {"calls": 0}
    if kernel:
        def counting(*args, real=getattr(torch, kernel), **kw):
            counted["calls"] += 1
            return real(*args, **kw)

        monkeypatch.setattr(torch, kernel, counting)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]).to(dtype)
    reference = copy.deepcopy(model)
    start = [p.detach().clone() for p in reference.parameters()]
    for i, layer in enumerate(model):
        apply_optimizer_in_backward(cls, layer.parameters(), {"lr": LRS[i % 3], **kwargs})
    ref_opt = cls([{"params": layer.parameters(), "lr": LRS[i % 3]} for i, layer in enumerate(reference)], **kwargs)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    overlap_optim.register_optimizer_hook(ddp)
    worst, calls = 0.0, []
    for step in range(4):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step), dtype=dtype)
        counted["calls"] = 0
        ddp(x).pow(2).sum().backward()
        calls.append(counted["calls"])
        reference(x).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())))
    moved = min((p - s).abs().max().item() for p, s in zip(reference.parameters(), start))
    return worst, calls, moved


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_default_dense_path_is_torchs_fused_kernel_once_per_setting(world_of_one, monkeypatch, name):
    worst, calls, moved = _train(name, torch.float32, monkeypatch)
    assert moved > 1e-4, "the reference did not move: the comparison proves nothing"
    assert worst <= 2e-5, f"{name}: {worst:.2e} from torch.optim"
    expected = len(LRS) if CONFIGS[name][2] else 0
    assert calls == [expected] * 4, f"{name}: fused calls per step {calls}"


@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_float64_takes_the_multi_tensor_update(world_of_one, monkeypatch, name):
    worst, calls, moved = _train(name, torch.float64, monkeypatch)
    assert moved > 1e-4 and worst <= 1e-12 and calls == [0] * 4, (worst, calls)
