"""FBGEMM's side of a fused table: its state names, its step count, and its live hyperparameters.

:mod:`sharders.optimizer_table` decides which settings FBGEMM computes exactly
and translates them; this module keeps a fused kernel in step with its
annotation group while it trains:

- before every forward, the group's live settings are checked against the same
  rule again and pushed into the kernel (``learning_rate``, ``eps``), so a
  scheduler, a user or ``load_state_dict`` reaches the very next backward. A
  change FBGEMM cannot compute (weight decay on Adagrad, momentum on SGD, a
  non-float setting) is refused there, naming the table and the setting;
- FBGEMM keeps no step count for Adagrad: ``overlap_steps`` counts the backward
  passes that reached the kernel, which is torch.optim's ``step``;
- :data:`FUSED_ROW_STATE` names FBGEMM's per-row state as torch.optim does.

TorchRec applies a fused kernel's LR only in ``fused_optimizer.step()``, after
backward: a schedule would reach the kernel one step late. Kernels are called
the same way under DMP and TorchRec's train pipelines, so their own forward
pre-hook is the one place that sees every step in time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn

from overlap_optim.spec import AnnotationGroup
from sharders.optimizer_table import KernelChoice, choose_kernel

__all__ = ["FUSED_ROW_STATE", "install_fused_kernel_hooks", "live_choice", "sync_live_settings"]

# Per-row state of each fused kernel type: torch.optim name -> row-wise (one value per row)?
FUSED_ROW_STATE = {
    EmbOptimType.EXACT_SGD: {},
    EmbOptimType.EXACT_ADAGRAD: {"sum": False},
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: {"sum": True},
}


def install_fused_kernel_hooks(kernels: Iterable[nn.Module], groups: dict[str, AnnotationGroup], device_type: str) -> None:
    """Keep each fused kernel's settings live (forward pre-hook) and count its steps (in backward)."""
    for kernel in kernels:
        kernel.overlap_tables = [t.name for t in kernel.config.embedding_tables]
        kernel.overlap_group = groups[kernel.overlap_tables[0]]
        kernel.overlap_device_type = device_type
        kernel.overlap_steps = 0
        kernel.register_forward_pre_hook(sync_live_settings)
        kernel.register_forward_hook(_count_step_in_backward)


def live_choice(group: AnnotationGroup, tables: list[str], device_type: str) -> KernelChoice:
    """FBGEMM's translation of the group's current settings; ValueError, naming ``tables`` and
    the setting, if a change made at run time is one FBGEMM cannot compute."""
    where = f"fused table(s) {tables}"
    group.spec.check_live(group.param_group, where)
    choice = choose_kernel(
        group.optimizer_class, group.optimizer_kwargs, device_type, table=tables[0], settings=group.param_group
    )
    if not choice.fused:
        raise ValueError(
            f"{where}: {choice.reason}. It was changed at run time ({group.spec.changed_floats(group.param_group)}), "
            "and the fused FBGEMM kernel cannot apply it exactly. Annotate the table with that setting from "
            "the start, or run it in the fallback: EmbeddingBagCollectionSharder(fallback_tables=[...])"
        )
    return choice


def sync_live_settings(kernel: nn.Module, _inputs: Any = None) -> None:
    """Push the group's current settings into the kernel, or refuse those FBGEMM cannot compute."""
    choice = live_choice(kernel.overlap_group, kernel.overlap_tables, kernel.overlap_device_type)
    emb = kernel.emb_module
    emb.set_learning_rate(choice.fbgemm_kwargs["learning_rate"])
    eps = choice.fbgemm_kwargs.get("eps")
    if eps is not None and emb.optimizer_args.eps != eps:
        emb.update_hyper_parameters({"eps": eps})


def _count_step_in_backward(kernel: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
    if output.requires_grad:
        output.register_hook(lambda grad: _add_step(kernel))


def _add_step(kernel: nn.Module) -> None:
    kernel.overlap_steps += 1
