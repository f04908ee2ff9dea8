"""The optimizer of one table shard: the real ``torch.optim`` update on a table, by kind.

- :class:`TableOptimizer`: what every kind shares: state under torch.optim's names, and
  the placeholder rule (``init_state`` makes state to load a checkpoint over; the next
  real update drops it unless something was loaded).
- :class:`RowOptimizer`: the rows of a table that a batch touched (lazy);
  :class:`DenseTableOptimizer`: a whole table, untouched rows on a zero gradient (and the
  base of :mod:`overlap_optim.cross_shard_base`'s layer-wise forms).
- :func:`step_tables` / :func:`step_touched`: the tables of one kernel at once: tables
  whose settings differ only in floats share one multi-tensor update
  (:mod:`overlap_optim.virtual_groups`), a table that steps in one compiled pass
  (:mod:`overlap_optim.row_pass`) steps so, the rest step alone.
"""

from __future__ import annotations

from math import prod as math_prod
from typing import Any, ClassVar

import torch

from overlap_optim import row_pass
from overlap_optim.spec import AnnotationGroup
from overlap_optim.state_precision import stored, working, write_back
from overlap_optim.update import versions
from overlap_optim.virtual_groups import VirtualKey, multi_tensor_step, virtual_key

__all__ = [
    "TableOptimizer", "RowOptimizer", "DenseTableOptimizer", "step_tables", "step_touched", "sum_rows", "math_dtype",
    "copy_bytes",
]


# -- touched rows: The real torch.optim update, applied to the rows of a table that a batch touched.
#
# :class:`RowOptimizer` keeps one table's optimizer state at full size and, each
# step, gathers the touched rows of the weight and of every row-shaped state
# tensor into a small parameter, runs the genuine ``torch.optim`` step on it, and
# scatters the results back. Its cost follows the number of touched rows, not the
# table size.
#
# Semantics (lazy, as the fused kernels and ``torch.optim.SparseAdam``):
#
# - Untouched rows and their row state do not change.
# - Duplicate ids are summed by the caller before one update.
# - State that is not per row (``step`` counters, NAdam's ``mu_product``) is per
#   table and advances at every step, touched rows or not (as a fused
#   kernel's iteration counter and ``SparseAdam`` on an empty gradient do), so every shard
#   of a table holds the same count.
# - When every row is touched at every step, the result is that of dense
#   ``torch.optim`` on the whole table.
# - A row touched for the first time after the table's first step starts from the
#   state the optimizer gives a fresh row after a zero-gradient step on a zero
#   weight (zeros for Adam's moments, ``initial_accumulator_value`` for Adagrad).
#   One visible consequence: SGD with ``dampening != 0`` starts such a row's
#   momentum at ``(1 - dampening) * g`` where torch's first step uses ``g``.


class TableOptimizer:
    """The optimizer of one 2-D table (or this rank's shard of it): the part every kind shares.

    It keeps the shard's state under torch.optim's names and holds the placeholder
    rule for tables, once: :meth:`init_state` makes state to load a checkpoint over
    (flagged ``placeholder_state``), and the next real update drops it unless
    :meth:`load_state` replaced it first. Subclasses give the update (:meth:`step`,
    or :meth:`prepare` and :meth:`finish` around a shared multi-tensor step) and
    where the state lives (:attr:`state`, :meth:`_make_placeholder`,
    :meth:`_clear_state`, :meth:`_set_state`).

    Args:
        weight: the table shard, ``(rows, dim)``, or the shard of a vector that a cross-shard
            optimizer steps under FSDP2 (:mod:`overlap_optim.cross_shard_base`); updated in place.
        group: the table's annotation.
        name: the table's name, for errors.
    """

    semantics: ClassVar[str]
    one_pass = False  # whether step() runs the compiled one-pass update (overlap_optim.row_pass)

    def __init__(self, weight: torch.Tensor, group: AnnotationGroup, name: str = "?") -> None:
        assert weight.dim() in (1, 2), "a table is 2-D (a cross-shard vector 1-D)"
        self.weight, self.group, self.name = weight, group, name
        self.param_group = group.param_group
        self._row_keys = group.spec.row_keys()
        self.placeholder_state = False

    # -- the placeholder rule --

    def init_state(self) -> None:
        """Create the state, if there is none yet, so that a checkpoint can be loaded in place.
        No weight changes. The state is a placeholder until something is loaded over it."""
        if self.state:
            return
        self._make_placeholder()
        self.placeholder_state = True
        self._placeholder_versions = versions(self.state)

    def drop_placeholder_state(self) -> None:
        """Undo :meth:`init_state` if nothing was loaded over it (also before every real update)."""
        if self.placeholder_state:
            self._clear_state()
            self.placeholder_state = False

    def holds_state(self) -> bool:
        """Some state entry, placeholder or real (plain SGD never holds any)."""
        return bool(self.state)

    def has_real_state(self) -> bool:
        """State that is not an :meth:`init_state` placeholder."""
        return bool(self.state) and not self.placeholder_state

    def placeholder_written(self) -> bool:
        """Whether the placeholder was written in place (``dcp.load``) without :meth:`load_state`."""
        return self.placeholder_state and versions(self.state) != self._placeholder_versions

    def restore_point(self) -> Callable[[], None]:
        """A function that puts the state back as it is now (what :meth:`load_state` replaces is
        rebound, never written: holding it is enough)."""
        state, placeholder = dict(self.state), self.placeholder_state
        made = getattr(self, "_placeholder_versions", None)

        def restore() -> None:
            self._clear_state()
            if state:
                self._set_state(state)
            self.placeholder_state, self._placeholder_versions = placeholder, made
        return restore

    def load_state(self, state: dict[str, Any]) -> None:
        """Replace the state with copies of ``state`` (names and shapes as :attr:`state`)."""
        self._clear_state()
        self._set_state({k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
        self.placeholder_state = False

    # -- the state, by layout --

    @property
    def state(self) -> dict[str, Any]:
        """The shard's state under torch.optim's names (empty before the first step)."""
        raise NotImplementedError

    @property
    def row_state(self) -> dict[str, torch.Tensor]:
        """Entries that slice by rows (saved as sharded tensors)."""
        return {k: v for k, v in self.state.items() if k in self._row_keys}

    @property
    def table_state(self) -> dict[str, Any]:
        """Every other entry (scalars, per-column and whole-table state), saved as plain values."""
        return {k: v for k, v in self.state.items() if k not in self._row_keys}

    def _make_placeholder(self) -> None:
        raise NotImplementedError

    def _clear_state(self) -> None:
        raise NotImplementedError

    def _set_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- the update --

    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Update the shard from the summed gradients ``grads`` of its rows ``ids`` (unique, 1-D, possibly empty)."""
        raise NotImplementedError

    def prepare(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """``(tensor to step, its gradient, its torch.optim state)``; :meth:`finish` writes the result back."""
        raise NotImplementedError

    def finish(self, ids: torch.Tensor, stepped_tensor: torch.Tensor, stepped: dict[str, Any]) -> None:
        """Write back what :meth:`prepare` handed out, once it has been stepped."""


class RowOptimizer(TableOptimizer):
    """``optimizer_class`` applied lazily to the touched rows of one 2-D table.

    Only for row-separable optimizers (``group.spec.row_separable``). Adam and AdamW on a
    float32 CPU table step in one compiled pass over the rows (:mod:`overlap_optim.row_pass`,
    :attr:`one_pass`) where the extension is built; every other table, and every table
    without it, gathers the rows, runs ``torch.optim``'s step on them and scatters them back.

    A table stored in FP16 or BF16 steps in float32, as ``torch.optim`` on a float32 copy of
    the rows as stored: the rows are read in float32, the gradient stays float32, the state is
    float32, and the updated rows are rounded once (to nearest even) when written back.

    Example:
        >>> rows = RowOptimizer(table_weight, table_weight_annotation_group, "t0")
        >>> rows.step(torch.tensor([3, 7]), row_grads)  # row_grads: (2, dim)
    """

    semantics = "lazy"

    def __init__(self, weight: torch.Tensor, group: AnnotationGroup, name: str = "?") -> None:
        assert group.spec.row_separable, f"{group.spec.name} is not row-separable"
        super().__init__(weight, group, name)
        self.math_dtype = math_dtype(weight.dtype)
        self.state_dtype = group.state_dtype or self.math_dtype  # what its rows' state is kept in
        # A reusable optimizer whose param and state are swapped in at each step.
        self._placeholder = torch.zeros(1, weight.shape[1], dtype=self.math_dtype, device=weight.device)
        self._optimizer = group.spec.make([self._placeholder])
        self._rows: dict[str, torch.Tensor] = {}
        self._table: dict[str, Any] = {}
        # Fixed at annotation, as everything it depends on (a changed fixed setting is refused).
        self.one_pass = row_pass.applies(group.spec, group.param_group, weight) and group.state_dtype is None

    @torch.no_grad()
    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """See :meth:`TableOptimizer.step`; in one pass (:attr:`one_pass`), ``ids`` may also
        repeat, each id's gradients summed in the order given."""
        if self.one_pass:
            if self._step_in_one_pass(ids, grads):
                return
            ids, grads = sum_rows(ids, grads)  # the other path takes each id once
        rows, rows.grad, state = self.prepare(ids, grads)
        if state:
            optimizer = self._optimizer
            optimizer.param_groups[0]["params"] = [rows]
            optimizer.state.clear()
            optimizer.state[rows] = state
        else:  # a new optimizer on the rows, so its own state init runs
            optimizer = self.group.spec.make([rows])
        try:
            self.group.step(optimizer, rows)
        finally:
            stepped = optimizer.state.pop(rows, {})
            self._optimizer.param_groups[0]["params"] = [self._placeholder]
        self.finish(ids, rows, stepped)

    def _step_in_one_pass(self, ids: torch.Tensor, grads: torch.Tensor) -> bool:
        """The compiled one-pass step; False (nothing done) if the state is not laid out for it."""
        assert ids.dim() == 1 and grads.shape == (ids.numel(), self.weight.shape[1])
        self.group.spec.check_live(self.param_group, f"table {self.name!r}")
        self.drop_placeholder_state()
        if not self._rows and not self._table:
            self._allocate()
        spec = self.group.spec
        return row_pass.step_adam(self.weight, self._rows, self._table, ids, grads, self.param_group, spec.fixed)

    def prepare(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """``(rows, their gradient, their torch.optim state)`` (empty state before the table's first step)."""
        assert ids.dim() == 1 and grads.shape == (ids.numel(), self.weight.shape[1])
        self.group.spec.check_live(self.param_group, f"table {self.name!r}")
        self.drop_placeholder_state()
        rows = self.weight.index_select(0, ids).to(self.math_dtype)
        return rows, grads.to(self.math_dtype), self.state_for_rows(ids)

    @torch.no_grad()
    def finish(self, ids: torch.Tensor, rows: torch.Tensor, stepped: dict[str, Any]) -> None:
        """Write the updated ``rows`` and their state ``stepped`` back into the table."""
        self._check_layout(stepped)
        if not self._rows and not self._table:
            self._allocate()
        self.weight.index_copy_(0, ids, rows.to(self.weight.dtype))  # low precision: the one rounding
        for key, value in stepped.items():
            if key in self._row_keys:  # rounded to the state's dtype (low-precision state: its one rounding)
                self._rows[key].index_copy_(0, ids, value.to(self._rows[key].dtype))
            else:
                self._table[key] = value

    @property
    def state(self) -> dict[str, Any]:
        return {**self._rows, **self._table}

    @property
    def row_state(self) -> dict[str, torch.Tensor]:
        return self._rows

    @property
    def table_state(self) -> dict[str, Any]:
        return self._table

    def state_for_rows(self, ids: torch.Tensor) -> dict[str, Any]:
        """The optimizer state of rows ``ids``, as torch.optim would hold it for them."""
        return {**{k: v.index_select(0, ids).to(self.math_dtype) for k, v in self._rows.items()}, **self._table}

    def _make_placeholder(self) -> None:
        """A step on no rows: the state exists, no weight changes."""
        empty = torch.empty(0, dtype=torch.long, device=self.weight.device)
        self.step(empty, self.weight.new_zeros(0, self.weight.shape[1], dtype=self.math_dtype))

    def _clear_state(self) -> None:
        self._rows, self._table = {}, {}

    def _set_state(self, state: dict[str, Any]) -> None:
        # loaded in another dtype than the state is kept in: cast once, to nearest even
        self._rows = {k: v.to(self.state_dtype) for k, v in state.items() if k in self._row_keys}
        self._table = {k: v for k, v in state.items() if k not in self._row_keys}

    def _check_layout(self, stepped: dict[str, Any]) -> None:
        """A float setting changed at run time can change the state an optimizer keeps (SGD's
        momentum from 0): the rows untouched so far would have no such state. Refuse."""
        known = set(self.group.spec.state or {})
        new = sorted(set(stepped) - known)
        if new:
            raise ValueError(
                f"table {self.name!r}: {self.group.spec.name} now keeps state {new} that it did not keep when "
                f"annotated, after {self.group.spec.changed_floats(self.param_group)} at run time; the rows not "
                "touched so far have none. Annotate the table with that setting from the start"
            )

    def _allocate(self) -> None:
        rows, dim = self.weight.shape
        for key in self._row_keys:
            entry = self.group.spec.state[key]
            shape = (rows, *(dim if size == -1 else size for size in entry.tail))
            self._rows[key] = torch.full(shape, entry.fresh, dtype=self.state_dtype, device=self.weight.device)


class DenseTableOptimizer(TableOptimizer):
    """``optimizer_class`` on the whole of one 2-D table (or shard), every step.

    Dense semantics, as ``torch.optim`` on an ``nn.EmbeddingBag`` with a dense
    gradient: rows the batch did not touch get a zero gradient and are stepped
    too. Exact for any optimizer while the table is whole, and on a shard split
    along an axis the optimizer is separable by. Cost follows the shard size.

    Each step runs between :meth:`ready` and :meth:`close` (a cross-shard form's two halves
    included, whatever a round does between them). A table stored in FP16 or BF16 steps
    :attr:`stepped`, a float32 copy of the shard made for the step, rounded once into the table
    when it closes: one shard-sized float32 buffer at the step's peak, none between steps. State
    kept in an annotation's ``state_dtype`` steps as float32 working copies, rounded into the
    stored state when the step closes (:mod:`overlap_optim.state_precision`); otherwise it is
    float32 (:func:`math_dtype`).
    """

    semantics = "dense"

    def __init__(self, weight: torch.Tensor, group: AnnotationGroup, name: str = "?") -> None:
        super().__init__(weight, group, name)
        self.math_dtype = math_dtype(weight.dtype)
        self.state_dtype = group.state_dtype  # None: its state is kept in math_dtype
        # What the optimizer steps: the table itself, or (low precision) a tensor whose storage is the
        # step's float32 copy, empty between steps; the optimizer's state is keyed by it.
        self.stepped = weight if self.math_dtype == weight.dtype else weight.detach().to(self.math_dtype)
        self._optimizer = group.spec.make([self.stepped])
        self._kept: dict[str, Any] | None = None  # the stored state, while a step works on float32 copies
        made = self._optimizer.state.pop(self.stepped, None)
        if made:  # state its constructor makes (Adagrad's sum) is kept as any state is: in its dtype
            self._set_state(made)
        self._release()

    @torch.no_grad()
    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Step the whole table on the gradient that is ``grads`` at rows ``ids`` and zero elsewhere."""
        stepped, stepped.grad, _ = self.prepare(ids, grads)
        try:
            self.group.step(self._optimizer, stepped)
        except BaseException:
            self._abandon()
            raise
        finally:
            stepped.grad = None
        self.close()

    def prepare(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """``(`` :attr:`stepped` ``, its whole gradient, its torch.optim state)``, updated in place
        by the caller; :meth:`finish` closes the step."""
        state = self.ready()
        return self.stepped, self.whole_gradient(ids, grads), state

    @torch.no_grad()
    def finish(self, ids: torch.Tensor, stepped_tensor: torch.Tensor, stepped: dict[str, Any]) -> None:
        self.close()

    def ready(self) -> dict[str, Any]:
        """Open a step: check the live settings, drop a placeholder state, make the float32 copy of
        a low-precision table and the float32 working copies of low-precision state; return the
        torch.optim state to update in place. A step opened before and never closed (its round
        discarded after an error) is forgotten."""
        self.group.spec.check_live(self.param_group, f"table {self.name!r}")
        self.drop_placeholder_state()
        self._abandon()
        if self.stepped is not self.weight:
            self.stepped.data = self.weight.to(self.math_dtype)
        self._kept = self._optimizer.state[self.stepped]
        (work,) = working([self._kept], [self.state_dtype])
        self._optimizer.state[self.stepped] = work
        return work

    @torch.no_grad()
    def close(self) -> None:
        """Close the step :meth:`ready` opened: the float32 copy rounded once into the table, the
        working state into the stored state (each to nearest even); the copy freed."""
        if self.stepped is not self.weight:
            self.weight.copy_(self.stepped)
        write_back([self._kept], [self._optimizer.state[self.stepped]], [self.state_dtype])
        self._optimizer.state[self.stepped] = self._kept
        self._kept = None
        self._release()

    def _abandon(self) -> None:
        """Forget an open step: the stored state put back, the copy freed, the table unchanged."""
        if self._kept is not None:
            self._optimizer.state[self.stepped] = self._kept
            self._kept = None
        self._release()

    def _release(self) -> None:
        """Free the step's float32 copy (low precision)."""
        if self.stepped is not self.weight:
            self.stepped.data = self.stepped.new_empty(0)

    def whole_gradient(self, ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        """The shard's gradient: ``grads`` at rows ``ids``, zero elsewhere (float32 for a low-precision table)."""
        grad = torch.zeros(self.weight.shape, dtype=self.math_dtype, device=self.weight.device)
        grad.index_copy_(0, ids, grads.to(grad.dtype))
        return grad

    @property
    def state(self) -> dict[str, Any]:
        return dict(self._optimizer.state.get(self.stepped, {}))

    @torch.no_grad()
    def _make_placeholder(self) -> None:
        """A step on a zero gradient, with the weight put back."""
        kept = self.weight.clone()
        no_rows = torch.empty(0, dtype=torch.long, device=self.weight.device)
        self.step(no_rows, self.weight.new_zeros((0, *self.weight.shape[1:]), dtype=self.math_dtype))
        self.weight.copy_(kept)

    def _clear_state(self) -> None:
        self._kept = None
        self._optimizer.state.clear()

    def _set_state(self, state: dict[str, Any]) -> None:
        # loaded in another dtype than the state is kept in: cast once, to nearest even
        dtype = self.state_dtype or self.math_dtype
        self._optimizer.state[self.stepped] = {k: stored(v, dtype) for k, v in state.items()}


def math_dtype(stored: torch.dtype) -> torch.dtype:
    """The dtype a table's update computes in, and its state's: float32 for a table stored in
    FP16 or BF16, the table's own dtype otherwise."""
    return torch.float32 if stored in (torch.float16, torch.bfloat16) else stored


def copy_bytes(shape: tuple[int, ...], stored: torch.dtype) -> int:
    """Bytes of the float32 copy that a :class:`DenseTableOptimizer` step of a shard of ``shape``
    stored in ``stored`` holds (:attr:`DenseTableOptimizer.stepped`): none for a float32 shard."""
    math = math_dtype(stored)
    return 0 if math == stored else math.itemsize * math_prod(shape)


def step_tables(updates: list[tuple[TableOptimizer, torch.Tensor, torch.Tensor]]) -> None:
    """``(table optimizer, unique row ids, their summed gradients)`` for each table of a kernel:
    a table that steps in one compiled pass (:attr:`TableOptimizer.one_pass`) steps so; the
    other tables of one virtual group share one multi-tensor update, each with its own float
    settings read from its param group now; the rest step alone."""
    sets: dict[VirtualKey, list[tuple[TableOptimizer, torch.Tensor, torch.Tensor]]] = {}
    for table, ids, grads in updates:
        table.group.spec.check_live(table.param_group, f"table {table.name!r}")
        key = None if table.one_pass else virtual_key(table.group.spec, table.param_group, table.weight)
        if key is None:
            table.step(ids, grads)
        else:
            sets.setdefault(key, []).append((table, ids, grads))
    for members in sets.values():
        prepared = [table.prepare(ids, grads) for table, ids, grads in members]
        params, grads, states = (list(x) for x in zip(*prepared))
        hypers = [table.param_group for table, _, _ in members]
        multi_tensor_step(members[0][0].group.spec, params, grads, states, hypers)
        for (table, ids, _), param, state in zip(members, params, states):
            table.finish(ids, param, state)


def step_touched(updates: list[tuple[TableOptimizer, torch.Tensor, torch.Tensor]]) -> None:
    """:func:`step_tables` on ``(table optimizer, row ids, a gradient per id)``, where ids may
    repeat: a table that steps in one pass sums a repeated id's gradients as it goes, the
    others are summed first (:func:`sum_rows`)."""
    step_tables([(t, ids, grads) if t.one_pass else (t, *sum_rows(ids, grads)) for t, ids, grads in updates])


def sum_rows(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique ids, the sum of each id's gradients)``; ``grads[i]`` is the gradient of ``ids[i]``."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype, device=grads.device)
    summed.index_add_(0, inverse, grads)
    return unique, summed
