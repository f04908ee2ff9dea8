"""The fused kind: FBGEMM's TBE runs the update; its state names, its step count, its live settings.

:mod:`sharders.optimizer_table` decides which settings FBGEMM computes exactly
and translates them; this module keeps a fused kernel in step with its
annotation group while it trains:

- before every forward, the group's live settings are checked against the same
  rule again and pushed into the kernel (``learning_rate``, ``eps``), so a
  scheduler, a user or ``load_state_dict`` reaches the very next backward. A
  change FBGEMM cannot compute (weight decay on Adagrad, momentum on SGD, a
  non-float setting) is refused there, naming the table and the setting;
- FBGEMM keeps no step count for Adagrad: each fused kernel counts the backward
  passes that reached it, which is torch.optim's ``step``;
- :data:`FUSED_ROW_STATE` names FBGEMM's per-row state as torch.optim does;
- FBGEMM's backward runs when :mod:`sharders.fused_backward` decides: at once,
  at the end of backward for a table clipped by norm, or at the last micro-batch
  of a ``no_step`` window.

TorchRec applies a fused kernel's LR only in ``fused_optimizer.step()``, after
backward: a schedule would reach the kernel one step late. Kernels are called
the same way under DMP and TorchRec's train pipelines, so their own forward
pre-hook is the one place that sees every step in time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn

from overlap_optim.spec import AnnotationGroup
from sharders.fused_backward import HeldBackward
from sharders.kernels import BuildContext, KernelChoice, KernelKind, LocalShard, TableKernel
from sharders.optimizer_table import VARIABLE_BATCH_OPTIMIZERS, choose_kernel

__all__ = ["FUSED_ROW_STATE", "FusedTable", "FusedShardState", "live_choice"]


# Per-row state of each fused kernel type: torch.optim name -> row-wise (one value per row)?
FUSED_ROW_STATE = {
    EmbOptimType.EXACT_SGD: {},
    EmbOptimType.EXACT_ADAGRAD: {"sum": False},
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: {"sum": True},
}


class FusedTable(TableKernel):
    """A table whose update FBGEMM's fused TBE kernel computes exactly (lazy semantics)."""

    kind = KernelKind.FUSED
    compute_kernel = "fused"
    # FBGEMM computes the same exact update with the table in HBM, in UVM, or cached in HBM (CUDA).
    plan_kernels = frozenset({"fused", "fused_uvm", "fused_uvm_caching"})

    def kernel_for(self, planned: str) -> str | None:
        return planned if planned in self.plan_kernels else self.compute_kernel

    def batch_key(self) -> Hashable:
        # A fused TBE has one learning rate: one kernel per annotation group (its LR schedule),
        # and one clipping set.
        return (self.kind, id(self.group), None if self.clip is None else self.clip.order)

    def fbgemm_kwargs(self) -> dict[str, Any]:
        return dict(self.decision.choice.fbgemm_kwargs)

    @classmethod
    def adopt(cls, kernel: nn.Module, tables: list[TableKernel], context: BuildContext) -> None:
        names = [t.table for t in tables]
        fused = _FusedKernel(kernel, names, tables[0].group, context.device_type)
        HeldBackward(kernel.emb_module, names, tables[0].clip, context.accumulation, fused.count)
        for index, (table, config) in enumerate(zip(tables, kernel.config.embedding_tables)):
            table.shards.append(LocalShard(config.local_metadata, FusedShardState(fused, index, table.state_layout())))

    def check_live(self) -> None:
        live_choice(self.group, [self.table], self.decision.device_type)

    def why_no_variable_batch(self) -> str | None:
        optimizer = self.decision.choice.fbgemm_kwargs["optimizer"]
        if optimizer not in VARIABLE_BATCH_OPTIMIZERS:
            return f"FBGEMM's {optimizer.name} kernel has no variable-batch backward"
        if self.clip is not None:
            return "it is clipped, and FBGEMM's variable-batch backward cannot be held for the norm"
        return None

    def state_layout(self) -> dict[str, str]:
        rowwise = FUSED_ROW_STATE[self.decision.choice.fbgemm_kwargs["optimizer"]]
        return {name: "row" if row else "element" for name, row in rowwise.items()}

    def scalar_names(self) -> list[str]:
        return ["step"] if self.state_layout() else []

    def state_bytes(self, shard_shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> int:
        # FBGEMM keeps its momentum in fp32 whatever the weights' dtype, row-wise ones as (rows,).
        rows, cols = shard_shape
        return sum(rows * (1 if layout == "row" else cols) * 4 for layout in self.state_layout().values())

    def runs_as(self) -> str:
        return f"fused {self.decision.choice.fbgemm_kwargs['optimizer'].name}"

    def why_not_fused(self) -> str:
        return ""


class _FusedKernel:
    """One fused TBE kernel of ours: its tables, their group, and its step count. Its forward
    pre-hook keeps FBGEMM's settings live; :mod:`sharders.fused_backward` counts its updates."""

    def __init__(self, kernel: nn.Module, tables: list[str], group: AnnotationGroup, device_type: str) -> None:
        self.emb, self.tables, self.group, self.device_type = kernel.emb_module, tables, group, device_type
        self.steps = 0
        kernel.register_forward_pre_hook(lambda _kernel, _inputs: self.sync_live_settings())

    def sync_live_settings(self) -> None:
        """Push the group's current settings into the kernel, or refuse those FBGEMM cannot compute."""
        choice = live_choice(self.group, self.tables, self.device_type)
        self.emb.set_learning_rate(choice.fbgemm_kwargs["learning_rate"])
        eps = choice.fbgemm_kwargs.get("eps")
        if eps is not None and self.emb.optimizer_args.eps != eps:
            self.emb.update_hyper_parameters({"eps": eps})

    def count(self) -> None:
        """FBGEMM ran one update of the kernel's tables."""
        self.steps += 1


class FusedShardState:
    """One table shard's state inside a fused kernel, as torch.optim names it (a
    :class:`sharders.kernels.ShardState`). FBGEMM allocates it with the kernel, so it always
    exists: there is no placeholder to make or drop."""

    placeholder_state = False

    def __init__(self, kernel: _FusedKernel, index: int, layout: dict[str, str]) -> None:
        self._kernel, self._index, self._layout = kernel, index, layout

    @property
    def row_state(self) -> dict[str, torch.Tensor]:
        if not self._layout:  # EXACT_SGD keeps none
            return {}
        states = self._kernel.emb.split_optimizer_states()[self._index]
        return {name: (t.view(-1, 1) if layout == "row" else t) for (name, layout), t in zip(self._layout.items(), states)}

    @property
    def table_state(self) -> dict[str, Any]:
        return {"step": torch.tensor(float(self._kernel.steps))} if self._layout else {}

    @property
    def state(self) -> dict[str, Any]:
        return {**self.row_state, **self.table_state}

    def has_real_state(self) -> bool:
        return bool(self._layout) and self._kernel.steps > 0  # EXACT_SGD keeps none

    def init_state(self) -> None:
        """Nothing to make: FBGEMM's state exists from the start."""

    def drop_placeholder_state(self) -> None:
        """Nothing to drop."""

    def placeholder_written(self) -> bool:
        """Never: FBGEMM's state is real, and a ``dcp.load`` in place fills it for good."""
        return False

    def restore_point(self) -> Callable[[], None]:
        """A function that puts the state back as it is now: :meth:`load_state` writes FBGEMM's
        buffers in place, so this holds a copy of them."""
        rows = {name: t.clone() for name, t in self.row_state.items()}
        steps = self._kernel.steps

        def restore() -> None:
            for name, target in self.row_state.items():
                target.copy_(rows[name])
            self._kernel.steps = steps
        return restore

    def load_state(self, state: dict[str, Any]) -> None:
        for name, target in self.row_state.items():
            target.copy_(state[name].view_as(target))
        if "step" in state:
            self._kernel.steps = int(float(state["step"]))


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
