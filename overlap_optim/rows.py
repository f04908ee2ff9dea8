"""The real torch.optim update, applied to the rows of a table that a batch touched.

:class:`RowOptimizer` keeps one table's optimizer state at full size and, each
step, gathers the touched rows of the weight and of every row-shaped state
tensor into a small parameter, runs the genuine ``torch.optim`` step on it, and
scatters the results back. Its cost follows the number of touched rows, not the
table size.

Semantics (lazy, as FBGEMM's fused kernels and ``torch.optim.SparseAdam``):

- Untouched rows and their row state do not change.
- Duplicate ids are summed by the caller before one update.
- State that is not per row (``step`` counters, NAdam's ``mu_product``) is per
  table and advances on each step that touches the table.
- When every row is touched at every step, the result is that of dense
  ``torch.optim`` on the whole table.
- A row touched for the first time after the table's first step starts from the
  state the optimizer gives a fresh row after a zero-gradient step on a zero
  weight (zeros for Adam's moments, ``initial_accumulator_value`` for Adagrad).
  One visible consequence: SGD with ``dampening != 0`` starts such a row's
  momentum at ``(1 - dampening) * g`` where torch's first step uses ``g``.
"""

from __future__ import annotations

from typing import Any

import torch

from overlap_optim.annotation import AnnotationGroup

__all__ = ["RowOptimizer"]

_PROBE_DIM = 3


class RowOptimizer:
    """``optimizer_class`` applied lazily to the touched rows of one 2-D table.

    Args:
        weight: the table (or this rank's shard of it), ``(rows, dim)``; updated in place.
        group: the table's annotation.
        param_group: where the current hyperparameters are read at every step
            (default: ``group.param_group``), so LR schedules reach the table.

    Example:
        >>> rows = RowOptimizer(table_weight, table_weight_annotation_group)
        >>> rows.step(torch.tensor([3, 7]), row_grads)  # row_grads: (2, dim)
    """

    def __init__(
        self, weight: torch.Tensor, group: AnnotationGroup, param_group: dict[str, Any] | None = None
    ) -> None:
        assert weight.dim() == 2, "a table is 2-D"
        self.weight = weight
        self.group = group
        self.param_group = group.param_group if param_group is None else param_group
        # A reusable optimizer whose param and state are swapped in at each step.
        self._placeholder = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        self._optimizer = group.optimizer_class([self._placeholder], **group.optimizer_kwargs)
        self._row_keys, self._fresh_rows = self._probe()
        self.row_state: dict[str, torch.Tensor] = {}
        self.table_state: dict[str, Any] = {}

    @torch.no_grad()
    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Update rows ``ids`` (unique, 1-D) with their summed gradients ``grads``."""
        assert ids.dim() == 1 and grads.shape == (ids.numel(), self.weight.shape[1])
        if ids.numel() == 0:
            return
        rows = self.weight.index_select(0, ids)
        rows.grad = grads.to(rows.dtype)
        first = not self.row_state and not self.table_state
        if first:  # a new optimizer on the rows, so its own state init runs
            optimizer = self.group.optimizer_class([rows], **self.group.optimizer_kwargs)
        else:
            optimizer = self._optimizer
            optimizer.param_groups[0]["params"] = [rows]
            optimizer.state.clear()
            optimizer.state[rows] = self.state_for_rows(ids)
        optimizer.param_groups[0].update({k: v for k, v in self.param_group.items() if k != "params"})
        try:
            optimizer.step()
        finally:
            stepped = optimizer.state.pop(rows, {})
            self._optimizer.param_groups[0]["params"] = [self._placeholder]
        if first:
            self._allocate()
        self.weight.index_copy_(0, ids, rows)
        for key, value in stepped.items():
            if key in self._row_keys:
                self.row_state[key].index_copy_(0, ids, value)
            else:
                self.table_state[key] = value

    @property
    def state(self) -> dict[str, Any]:
        """The whole table's state under torch.optim's names (empty before the first step)."""
        return {**self.row_state, **self.table_state}

    def state_for_rows(self, ids: torch.Tensor) -> dict[str, Any]:
        """The optimizer state of rows ``ids``, as torch.optim would hold it for them."""
        return {**{k: v.index_select(0, ids) for k, v in self.row_state.items()}, **self.table_state}

    def _allocate(self) -> None:
        rows, dim = self.weight.shape
        for key, (fill, tail) in self._fresh_rows.items():
            shape = (rows, *(dim if size == _PROBE_DIM else size for size in tail))
            self.row_state[key] = torch.full(shape, fill, dtype=self.weight.dtype, device=self.weight.device)

    def _probe(self) -> tuple[set[str], dict[str, tuple[float, tuple[int, ...]]]]:
        """Which state entries are per row, and what a fresh row holds.

        One step on a zero ``(2, 3)`` stand-in with a zero gradient: entries whose
        first dimension is 2 are per row, with the fresh value they hold and their
        trailing shape (3 standing for the table's dim).
        """
        stand_in = torch.zeros(2, _PROBE_DIM, dtype=self.weight.dtype)
        stand_in.grad = torch.zeros_like(stand_in)
        probe = self.group.optimizer_class([stand_in], **self.group.optimizer_kwargs)
        probe.step()
        fresh = {}
        for key, value in probe.state[stand_in].items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == 2:
                fresh[key] = (value.flatten()[0].item(), tuple(value.shape[1:]))
        return set(fresh), fresh
