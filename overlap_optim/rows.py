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
  table and advances at every step, touched rows or not (as FBGEMM's
  iteration counter and ``SparseAdam`` on an empty gradient do), so every shard
  of a table holds the same count.
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

__all__ = ["RowOptimizer", "state_layout", "PROBE_DIM"]

PROBE_DIM = 3


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
        self._fresh_rows, _ = state_layout(group, weight.dtype)
        self._row_keys = set(self._fresh_rows)
        self.row_state: dict[str, torch.Tensor] = {}
        self.table_state: dict[str, Any] = {}
        self.placeholder_state = False

    @torch.no_grad()
    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Update rows ``ids`` (unique, 1-D, possibly empty) with their summed gradients ``grads``."""
        assert ids.dim() == 1 and grads.shape == (ids.numel(), self.weight.shape[1])
        if self.placeholder_state:  # made by init_state and never loaded over: start afresh
            self.row_state, self.table_state, self.placeholder_state = {}, {}, False
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

    def init_state(self) -> None:
        """Create the state, if there is none yet, so that a checkpoint can be loaded in place.

        It is a step on no rows: no weight changes. The state it makes is a
        placeholder, dropped at the next step unless something is loaded over it.
        """
        if self.state:
            return
        empty = torch.empty(0, dtype=torch.long, device=self.weight.device)
        self.step(empty, self.weight.new_zeros(0, self.weight.shape[1]))
        self.placeholder_state = True

    def load_state(self, state: dict[str, Any]) -> None:
        """Replace the state with copies of ``state`` (names and shapes as :attr:`state`)."""
        self.row_state = {k: v.detach().clone() for k, v in state.items() if k in self._row_keys}
        self.table_state = {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items() if k not in self._row_keys
        }
        self.placeholder_state = False

    @property
    def row_keys(self) -> set[str]:
        """The names of the per-row state entries."""
        return set(self._row_keys)

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
            shape = (rows, *(dim if size == PROBE_DIM else size for size in tail))
            self.row_state[key] = torch.full(shape, fill, dtype=self.weight.dtype, device=self.weight.device)


def state_layout(
    group: AnnotationGroup, dtype: torch.dtype = torch.float32
) -> tuple[dict[str, tuple[float, tuple[int, ...]]], list[str]]:
    """Which state entries of ``group``'s optimizer are per row, and what a fresh row holds.

    Returns ``({name: (fresh value, trailing shape)}, [per-table names])``, where a trailing size of
    ``PROBE_DIM`` stands for the table's dim. It runs one step on a zero
    ``(2, PROBE_DIM)`` stand-in with a zero gradient: entries whose first
    dimension is 2 are per row; the others (``step``...) are per table.
    """
    stand_in = torch.zeros(2, PROBE_DIM, dtype=dtype)
    stand_in.grad = torch.zeros_like(stand_in)
    probe = group.optimizer_class([stand_in], **group.optimizer_kwargs)
    probe.step()
    fresh = {}
    for key, value in probe.state[stand_in].items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == 2:
            fresh[key] = (value.flatten()[0].item(), tuple(value.shape[1:]))
    return fresh, [key for key in probe.state[stand_in] if key not in fresh]
