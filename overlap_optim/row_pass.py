"""The compiled one-pass update of a table's touched rows (Adam and AdamW on CPU).

The lazy fallback update (:class:`overlap_optim.table_optimizer.RowOptimizer`) otherwise takes five
passes over the touched rows: it sums the gradients of duplicate ids, gathers the rows of the
weight and of each moment, steps them with ``torch.optim``'s math, and scatters them back. On a
table larger than cache those gathers and scatters are most of a step. The operator
``overlap_optim::adam_rows_`` (``overlap_optim/csrc/row_pass.cpp``, :mod:`overlap_optim.compiled`) does
the same in one pass: each touched row is read once, its gradients summed, stepped with
``torch.optim``'s single-tensor Adam arithmetic, and written back in place.

Which path a table takes is a function of its settings only, the same on every rank: the one
pass for ``torch.optim.Adam`` and ``AdamW`` (``amsgrad``, ``maximize`` and either weight decay
included) on a float32 CPU table, with float32 step counters (torch's default), when the
extension is built; the five passes otherwise. A group that asks torch for ``foreach``,
``fused``, ``capturable`` or ``differentiable`` keeps torch's own step, as everywhere
(:func:`overlap_optim.virtual_groups.virtual_key`). Without a C++ compiler at install time the
extension is absent and every table takes the five passes: same results, slower.

The state is ``torch.optim``'s, named as it names it; the ``step`` counter advances as its own
does, and the bias corrections are computed here in Python as it computes them.
"""

from __future__ import annotations

from typing import Any

import torch

from overlap_optim import compiled
from overlap_optim.spec import OptimizerSpec
from overlap_optim.virtual_groups import step_counters, virtual_key

__all__ = ["available", "applies", "step_adam"]

_ADAM = (torch.optim.Adam, torch.optim.AdamW)


_ADAM_ROWS = compiled.op("adam_rows_")


def available() -> bool:
    """Whether the compiled one pass was built and loaded."""
    return _ADAM_ROWS is not None


def applies(spec: OptimizerSpec, param_group: dict[str, Any], weight: torch.Tensor) -> bool:
    """Whether a table ``weight`` annotated with ``spec`` (live settings ``param_group``) steps
    in one compiled pass. Depends on the settings, dtype and device only."""
    return (
        _ADAM_ROWS is not None
        and spec.optimizer_class in _ADAM
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.get_default_dtype() == torch.float32
        and virtual_key(spec, param_group, weight) is not None
    )


def step_adam(weight: torch.Tensor, rows: dict[str, torch.Tensor], table: dict[str, Any], ids: torch.Tensor,
              grads: torch.Tensor, hypers: dict[str, Any], fixed: dict[str, Any]) -> bool:
    """One Adam (AdamW) step of the rows ``ids`` of ``weight``, in place, on the sum of their
    ``grads`` (ids may repeat: a repeated id's gradients are summed in the order given).

    ``rows`` holds the full-size moments (``exp_avg``, ``exp_avg_sq``, and ``max_exp_avg_sq``
    with ``amsgrad``), ``table`` the ``step`` counter (made, as torch makes it, if missing),
    ``hypers`` the live param group and ``fixed`` the non-float settings. Returns False, having
    done nothing, when a tensor is not laid out as the kernel needs (a state loaded from
    elsewhere); the caller then takes the five-pass path."""
    names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if fixed.get("amsgrad") else ("exp_avg", "exp_avg_sq")
    tensors = [weight, *(rows[n] for n in names)]
    if not all(t.is_contiguous() and t.dtype == torch.float32 and t.shape == weight.shape for t in tensors):
        return False
    counter = table.get("step")
    if counter is not None and counter.dtype != torch.float32:
        return False
    step = float(step_counters([table])[0])
    lr, eps, weight_decay = float(hypers["lr"]), float(hypers["eps"]), float(hypers["weight_decay"])
    beta1, beta2 = float(hypers["betas"][0]), float(hypers["betas"][1])
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    _ADAM_ROWS(
        weight, rows["exp_avg"], rows["exp_avg_sq"], rows.get("max_exp_avg_sq") if fixed.get("amsgrad") else None,
        ids.to(torch.long).contiguous(), grads.to(torch.float32).contiguous(), lr, beta1, beta2, eps, weight_decay,
        step_size, bias_correction2_sqrt, bool(fixed.get("decoupled_weight_decay")), bool(fixed.get("maximize")),
    )
    return True
