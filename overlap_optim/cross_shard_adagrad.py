"""torchrec's ``RowWiseAdagrad`` across column shards (:class:`RowWiseAdagradTable`).

Each row's accumulator ``sum`` (R, 1) adds the mean of ``g^2`` over the row's columns, which
column shards split; row shards are separable by rows and need no round. Weight decay has
no cross-shard form (it would decay every row under dense semantics): refused.

Per step, one slot in the ``STATISTICS`` round, summed across ranks: each row's partial sum
of ``g^2`` over the shard's columns, R floats.
"""

from __future__ import annotations

import torch

from overlap_optim.cross_shard_base import CrossShardOptimizer

__all__ = ["RowWiseAdagradTable"]


class RowWiseAdagradTable(CrossShardOptimizer):
    """torchrec's ``RowWiseAdagrad`` on column shards: each row's accumulator adds the mean of
    ``g^2`` over the row's columns, which the shards split.

    Every column shard holds every row, so each holds the whole ``sum`` (R, 1), and the same
    touched rows. One round carries each row's partial sum of ``g^2`` over the shard's columns
    (R floats per table); each shard then adds the row means to its ``sum`` and steps its
    columns of the touched rows. An untouched row's gradient is zero: it adds nothing and does
    not move, so the step is the same under lazy and dense semantics, without weight decay.
    Stock TorchRec gives each column shard its own accumulator instead: another optimizer.
    """

    @classmethod
    def slot_size(cls, geometry):
        return geometry.table_shape[0]

    @classmethod
    def _temporary_bytes(cls, geometry, shard_shape, dtype):
        return 0  # beside the slot's partial sums (counted), the touched rows': the batch's size

    @classmethod
    def _held_bytes(cls, geometry, shard_shape, dtype):
        return 0  # the touched rows and their gradients

    @classmethod
    def unsupported(cls, spec, axis):
        if axis != 1:
            return f"{spec.name} is separable by rows"
        if spec.kwargs.get("weight_decay", 0.0) != 0:
            return (f"weight_decay={spec.kwargs['weight_decay']!r} decays every row under dense semantics and "
                    "only the touched rows under lazy ones; its column-shard form is built without weight decay")
        return None

    def _check_settings(self):
        self._touched: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, grads) between the halves

    def _fresh_state(self, state):
        state["step"] = torch.tensor(0.0)
        initial = self.group.param_group["initial_accumulator_value"]
        state["sum"] = self.stepped.new_full((self.stepped.shape[0], 1), initial)

    def partials(self, ids, grads, state, h):
        if "sum" not in state:
            self._fresh_state(state)
        state["step"] += 1
        self._touched = ids, grads
        per_row = torch.zeros(self.geometry.table_shape[0], dtype=torch.float64)
        return per_row.index_copy_(0, ids, grads.double().square().sum(1))

    def complete(self, stats):
        h, state = self.group.param_group, self._optimizer.state[self.stepped]
        ids, grads = self._touched
        total = state["sum"]
        total.index_add_(0, ids, (stats.index_select(0, ids) / self.geometry.table_shape[1]).to(total.dtype)[:, None])
        std = total.index_select(0, ids).sqrt_().add_(h["eps"])
        step_size = h["lr"] / (1 + (float(state["step"]) - 1) * h["lr_decay"])
        self.stepped.index_add_(0, ids, grads / std, alpha=-step_size)
        self._touched = None
