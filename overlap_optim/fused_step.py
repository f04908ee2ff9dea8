"""One fused or multi-tensor update for many annotated parameters at once.

Parameters whose optimizer class and non-float settings agree (Adam's amsgrad,
SGD's nesterov, RMSprop's centered, ...) are stepped together, each with its own
float hyperparameters (lr, betas, eps, weight_decay, momentum): foreach ops take
a list of scalars. That gives virtual parameter groups: three learning rates on
300 parameters cost one update, not 300 Python-level steps.

The math is ``torch.optim``'s own: for Adam and AdamW its fused kernel, called
once per distinct set of float hyperparameters (three learning rates, three
calls); for SGD and RMSprop its multi-tensor path, op for op, with scalars made
lists. State lives in each parameter's live optimizer under torch's names,
so checkpoints and ``get_optimizers`` see no difference. Classes or settings
not listed here (and ``foreach``/``fused``/``capturable``/``differentiable``
set by the user) fall back to the parameter's own ``torch.optim`` step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from overlap_optim.annotation import live_optimizer, step_param

__all__ = ["step_params", "fused_key"]

_Key = tuple[Any, ...]


def fused_key(param: torch.Tensor) -> _Key | None:
    """Parameters with equal keys share one foreach update; None: step alone."""
    group = param._overlap_group
    h = group.param_group
    if any(h.get(flag) for flag in ("foreach", "fused", "capturable", "differentiable")) or param.is_sparse:
        return None
    cls = group.optimizer_class
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        return ("adam", bool(h["amsgrad"]), bool(h["maximize"]), bool(h.get("decoupled_weight_decay")) or cls is torch.optim.AdamW)
    if cls is torch.optim.SGD:
        return ("sgd", bool(h["nesterov"]), bool(h["maximize"]), h["momentum"] != 0)
    if cls is torch.optim.RMSprop:
        return ("rmsprop", bool(h["centered"]), bool(h["maximize"]), h["momentum"] > 0)
    return None


def step_params(params: list[torch.Tensor]) -> None:
    """Step every param (each has ``.grad`` set) and release its grad: one foreach
    update per set of compatible settings, the param's own step for the rest."""
    sets: dict[_Key, list[torch.Tensor]] = {}
    for param in params:
        key = fused_key(param)
        if key is None:
            step_param(param)
        else:
            sets.setdefault(key, []).append(param)
    for key, members in sets.items():
        states = [_state_of(p) for p in members]
        hypers = [p._overlap_group.param_group for p in members]
        grads = [p.grad for p in members]
        with torch.no_grad():
            _UPDATES[key[0]](members, grads, states, hypers, *key[1:])
        for p in members:
            p.grad = None


def _state_of(param: torch.Tensor) -> dict[str, Any]:
    optimizer = live_optimizer(param)
    if param.__dict__.pop("_overlap_placeholder_state", False):
        optimizer.state.pop(param, None)  # made by init_state() and never loaded over
    return optimizer.state[param]


def _step_counts(states: list[dict], params: list[torch.Tensor]) -> list[torch.Tensor]:
    for state in states:
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
    steps = [s["step"] for s in states]
    torch._foreach_add_(steps, 1)
    return steps


def _zeros(states: list[dict], params: list[torch.Tensor], name: str) -> list[torch.Tensor]:
    for state, p in zip(states, params):
        if name not in state:
            state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return [s[name] for s in states]


def _adam(params, grads, states, hypers, amsgrad: bool, maximize: bool, decoupled: bool) -> None:
    """torch's fused Adam kernel, one call per distinct set of float hyperparameters."""
    exp_avgs, exp_avg_sqs = _zeros(states, params, "exp_avg"), _zeros(states, params, "exp_avg_sq")
    max_sqs = _zeros(states, params, "max_exp_avg_sq") if amsgrad else []
    steps = _step_counts(states, params)
    floats: dict[tuple[float, ...], list[int]] = {}
    for i, h in enumerate(hypers):
        key = (float(h["lr"]), float(h["betas"][0]), float(h["betas"][1]), float(h["weight_decay"]), float(h["eps"]))
        floats.setdefault(key, []).append(i)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    for (lr, beta1, beta2, weight_decay, eps), index in floats.items():
        def pick(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            return [tensors[i] for i in index] if tensors else []

        kernel(
            pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(max_sqs), pick(steps),
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
            amsgrad=amsgrad, maximize=maximize,
        )


def _sgd(params, grads, states, hypers, nesterov: bool, maximize: bool, has_momentum: bool) -> None:
    if maximize:
        grads = torch._foreach_neg(grads)
    wds = [float(h["weight_decay"]) for h in hypers]
    if any(wds):
        grads = torch._foreach_add(grads, torch._foreach_mul(params, wds))
    if has_momentum:
        momenta = [float(h["momentum"]) for h in hypers]
        bufs = []
        for state, grad, h, momentum in zip(states, grads, hypers, momenta):
            buf = state.get("momentum_buffer")
            if buf is None:
                state["momentum_buffer"] = buf = torch.clone(grad).detach()
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - float(h["dampening"]))
            bufs.append(buf)
        grads = torch._foreach_add(grads, torch._foreach_mul(bufs, momenta)) if nesterov else bufs
    torch._foreach_add_(params, torch._foreach_mul(grads, [-float(h["lr"]) for h in hypers]))


def _rmsprop(params, grads, states, hypers, centered: bool, maximize: bool, has_momentum: bool) -> None:
    if maximize:
        grads = torch._foreach_neg(grads)
    square_avgs = _zeros(states, params, "square_avg")
    grad_avgs = _zeros(states, params, "grad_avg") if centered else []
    bufs = _zeros(states, params, "momentum_buffer") if has_momentum else []
    _step_counts(states, params)
    wds = [float(h["weight_decay"]) for h in hypers]
    if any(wds):
        grads = torch._foreach_add(grads, torch._foreach_mul(params, wds))
    alphas = [float(h["alpha"]) for h in hypers]
    torch._foreach_mul_(square_avgs, alphas)
    torch._foreach_addcmul_(square_avgs, grads, grads, [1 - a for a in alphas])
    if centered:
        torch._foreach_lerp_(grad_avgs, grads, [1 - a for a in alphas])
        avg = torch._foreach_addcmul(square_avgs, grad_avgs, grad_avgs, [-1.0] * len(params))
        torch._foreach_sqrt_(avg)
    else:
        avg = torch._foreach_sqrt(square_avgs)
    torch._foreach_add_(avg, [float(h["eps"]) for h in hypers])
    lrs = [-float(h["lr"]) for h in hypers]
    if has_momentum:
        torch._foreach_mul_(bufs, [float(h["momentum"]) for h in hypers])
        torch._foreach_addcdiv_(bufs, grads, avg)
        torch._foreach_add_(params, torch._foreach_mul(bufs, lrs))
    else:
        torch._foreach_addcdiv_(params, grads, avg, lrs)


_UPDATES: dict[str, Callable[..., None]] = {"adam": _adam, "sgd": _sgd, "rmsprop": _rmsprop}
