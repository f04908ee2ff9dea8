"""torch's fused CPU kernels for a virtual group: one call per distinct set of float settings.

On CPU a foreach op is a loop of per-tensor kernels, so the multi-tensor update
of :mod:`overlap_optim.virtual_groups` makes about ten passes over each tensor. torch's fused
kernels (Adam, AdamW, SGD and Adagrad: what ``torch.optim.Adam(fused=True)`` calls, reached
through :data:`overlap_optim._private.fused`) make one. They take their settings as scalars, so a
virtual group is split by its float settings: one call per distinct setting (48 learning
rates: 48 calls, each over its tensors).

Which path runs is a function of the group's contents only, the same on every rank: the
fused kernel for Adam, AdamW, SGD and Adagrad on float32 CPU tensors (with float32 ``step``
counters, torch's default), the multi-tensor update otherwise. On CUDA the foreach ops are
real multi-tensor kernels, and the state layout (``step`` on the host) stays torch's default one.

The state is ``torch.optim``'s, created and named as it creates it; the math is its fused
kernel's, which rounds differently from the single-tensor path by about 1e-7.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from overlap_optim._private import fused

__all__ = ["fused_step", "applies", "FUSED"]


def fused_step(optimizer_class: type, fixed: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
               states: list[dict[str, Any]], hypers: list[dict[str, Any]],
               steps: Callable[[list[dict]], list[torch.Tensor]], make_state: Callable[..., list]) -> bool:
    """Update ``params`` with torch's fused kernel, one call per distinct float setting; False
    (nothing done) where no fused kernel applies. ``steps(states)`` advances and returns the
    ``step`` counters of ``states``, ``make_state(states, params, name, fill=None)`` a state
    entry of each tensor, made if missing: both as the multi-tensor update makes them."""
    update = FUSED.get(optimizer_class)
    if update is None or not _fusable(params, states):
        return False
    # The tensors of one annotation share their param group: read each group once.
    groups = [id(h) for h in hypers]
    settings = {group: update.key(h) for group, h in dict(zip(groups, hypers)).items()}
    counters = steps(states) if update.counts_steps else [None] * len(states)  # one call for all
    if update.starts_state is None and len(set(settings.values())) == 1:
        update(params, grads, states, counters, hypers[0], fixed, make_state)
        return True
    by_setting: dict[tuple, list[int]] = {}
    for i, group in enumerate(groups):
        key = settings[group]
        if update.starts_state is not None:
            key = (*key, update.starts_state(states[i]))
        by_setting.setdefault(key, []).append(i)
    for index in by_setting.values():
        update([params[i] for i in index], [grads[i] for i in index], [states[i] for i in index],
               [counters[i] for i in index], hypers[index[0]], fixed, make_state)
    return True


def applies(optimizer_class: type, tensor: torch.Tensor) -> bool:
    """Whether a fused kernel here can update ``tensor``: a class with one, a float32 CPU tensor
    (not a DTensor: torch's fused kernels have no DTensor rule), float32 the default dtype. The
    ``step`` counters are checked at each step (:func:`fused_step`)."""
    return (optimizer_class in FUSED and type(tensor) in (torch.Tensor, torch.nn.Parameter)
            and tensor.device.type == "cpu" and tensor.dtype == torch.float32
            and torch.get_default_dtype() == torch.float32)


def _fusable(params: list[torch.Tensor], states: list[dict[str, Any]]) -> bool:
    """Float32 CPU tensors (a virtual group's agree in device and dtype) and float32 step counters."""
    if params[0].device.type != "cpu" or params[0].dtype != torch.float32 or torch.get_default_dtype() != torch.float32:
        return False
    for state in states:
        step = state.get("step")
        if step is not None and step.dtype != torch.float32:
            return False
    return True


class _Adam:
    counts_steps, starts_state = True, None

    @staticmethod
    def key(h):
        return (float(h["lr"]), float(h["betas"][0]), float(h["betas"][1]), float(h["eps"]), float(h["weight_decay"]))

    def __call__(self, params, grads, states, counters, h, fixed, make_state):
        exp_avgs, exp_avg_sqs = make_state(states, params, "exp_avg"), make_state(states, params, "exp_avg_sq")
        amsgrad = bool(fixed.get("amsgrad"))
        max_sqs = make_state(states, params, "max_exp_avg_sq") if amsgrad else []
        kernel = fused.adamw_ if fixed.get("decoupled_weight_decay") else fused.adam_
        kernel(params, grads, exp_avgs, exp_avg_sqs, max_sqs, counters, lr=float(h["lr"]), beta1=float(h["betas"][0]),
               beta2=float(h["betas"][1]), weight_decay=float(h["weight_decay"]), eps=float(h["eps"]), amsgrad=amsgrad,
               maximize=bool(fixed.get("maximize")))


class _Adagrad:
    counts_steps = True

    @staticmethod
    def key(h):  # initial_accumulator_value: a sum made at this call starts at it
        return (float(h["lr"]), float(h["lr_decay"]), float(h["weight_decay"]), float(h["eps"]),
                float(h["initial_accumulator_value"]))

    @staticmethod
    def starts_state(state):
        return "sum" not in state

    def __call__(self, params, grads, states, counters, h, fixed, make_state):
        sums = make_state(states, params, "sum", [float(h["initial_accumulator_value"])] * len(params))
        fused.adagrad_(params, grads, sums, counters, lr=float(h["lr"]), lr_decay=float(h["lr_decay"]),
                       weight_decay=float(h["weight_decay"]), eps=float(h["eps"]), maximize=bool(fixed.get("maximize")))


class _SGD:
    counts_steps = False

    @staticmethod
    def key(h):
        return (float(h["lr"]), float(h["momentum"]), float(h["dampening"]), float(h["weight_decay"]))

    @staticmethod
    def starts_state(state):  # the first step with momentum starts the buffer from the gradient
        return state.get("momentum_buffer") is None

    def __call__(self, params, grads, states, counters, h, fixed, make_state):
        momentum = float(h["momentum"])
        first = momentum != 0 and states[0].get("momentum_buffer") is None
        if momentum == 0:
            buffers = []
        else:
            for state, g in zip(states, grads):
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.empty_like(g)
            buffers = [s["momentum_buffer"] for s in states]
        fused.sgd_(params, grads, buffers, weight_decay=float(h["weight_decay"]), momentum=momentum,
                   lr=float(h["lr"]), dampening=float(h["dampening"]), nesterov=bool(fixed.get("nesterov")),
                   maximize=bool(fixed.get("maximize")), is_first_step=first)


# The classes with a fused kernel; exactly these classes (a subclass may change step()).
FUSED: dict[type, Any] = {
    torch.optim.Adam: _Adam(),
    torch.optim.AdamW: _Adam(),
    torch.optim.SGD: _SGD(),
    torch.optim.Adagrad: _Adagrad(),
}
