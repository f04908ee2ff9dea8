"""The cross-shard step: a layer-wise optimizer on a tensor split across ranks, stepped as on the
whole tensor, with its whole-tensor statistics in one all-reduce per step.

LAMB and LARS scale an update by a trust ratio of whole-tensor norms; Adafactor and CAME by
the RMS of the whole update and factored second moments; Muon orthogonalises the whole
update. On a tensor split into row or column shards (a table under ``sharders``, a
parameter under FSDP2), no shard can compute those alone. :class:`CrossShardOptimizer`
steps each shard in two halves:

1. In backward, :meth:`~CrossShardOptimizer.partials` runs the first half of the update on
   the shard's own rows or columns (moments, weight decay, the raw update) and returns the
   partial sums the second half needs (``||w||^2``, ``||u||^2`` ...), which go into the
   tensor's slot of the module's end-of-backward round.
2. When backward ends, the round (:class:`overlap_optim.round.EndOfBackwardRound`, phase
   ``STATISTICS``) sums every slot across ranks in **one all-reduce**: one tensor or forty
   cost the same one collective per step.
3. :meth:`~CrossShardOptimizer.complete` finishes the shard's update with the whole-tensor
   statistics.

The result is the unsharded optimizer's, with dense semantics (every row steps, untouched
rows of a table on a zero gradient). Every rank takes part in the round in the same order, a
rank that holds an empty shard included: it contributes zeros for what it does not hold.

:class:`Geometry` says where a shard sits, :func:`sharded_state_layouts` which state entries
are sharded as the weight; :func:`nbytes` and :func:`square_norm` serve the forms' byte
counts and norms. Each optimizer's form has its own file (``cross_shard_adafactor``,
``cross_shard_came``, ``cross_shard_lamb``, ``cross_shard_muon``, ``cross_shard_galore``,
``cross_shard_adagrad``),
and :mod:`overlap_optim.cross_shard` maps optimizer classes to them; ``sharders.cross_shard``
builds them for table shards, :mod:`overlap_optim.fsdp` for FSDP2's parameter shards.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from overlap_optim.round import EndOfBackwardRound, Phase
from overlap_optim.spec import AnnotationGroup, OptimizerSpec
from overlap_optim.table_optimizer import DenseTableOptimizer, copy_bytes, math_dtype

__all__ = ["CrossShardOptimizer", "BlockForm", "GatherForm", "Geometry", "sharded_state_layouts", "nbytes", "square_norm"]

_VECTOR_PROBE = 7  # elements of the stand-in vector whose state shapes say which entries are per element


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Where one local shard sits in its tensor, and the axis the tensor is split along.

    A table (2-D): ``axis`` 0 for row shards, each with every column, 1 for column shards,
    each with every row. A vector (1-D, ``table_shape`` and ``offsets`` of one element):
    ``axis`` 0, its only one.
    """

    table_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    axis: int

    @property
    def numel(self) -> int:
        """Elements of the whole tensor."""
        return math.prod(self.table_shape)


def sharded_state_layouts(spec: OptimizerSpec, axis: int, ndim: int = 2) -> dict[str, str]:
    """The state entries of a table split along ``axis`` (0: rows) that are sharded as its weight
    is, ``name -> a layout of LAYOUTS``; the others (scalars, and the factors along the unsplit
    axis, which every shard holds whole) are per-table values. For a vector (``ndim`` 1): the
    entries shaped as the vector, "element", probed on a stand-in (the optimizer's 1-D state
    need not be its 2-D one: Adafactor's ``variance``)."""
    if ndim == 1:
        shapes = spec.state_shapes((_VECTOR_PROBE,))
        return {name: "element" for name, shape in shapes.items() if shape == (_VECTOR_PROBE,)}
    layouts = {}
    for name, entry in (spec.state or {}).items():
        if entry.layout == "element":
            layouts[name] = "element"
        elif entry.layout == "row" and entry.tail in ((1,), ()) and axis == 0:
            layouts[name] = "row" if entry.tail else "row_vector"
        elif entry.layout == "column" and entry.tail in ((1,), ()) and axis == 1:
            layouts[name] = "column" if entry.tail else "column_vector"
    return layouts


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def square_norm(tensor: torch.Tensor) -> torch.Tensor:
    """``||tensor||^2`` of a 2-D tensor, in float64, without a copy of it: torch's float64 norm of a
    float32 tensor (``vector_norm(t, dtype=torch.float64)``) casts it whole first, 8 bytes an
    element. The norms along the longer axis are taken in float32 (or wider), their squares
    summed in float64."""
    longer = 0 if tensor.shape[0] >= tensor.shape[1] else 1
    norms = torch.linalg.vector_norm(tensor, dim=longer, dtype=torch.promote_types(tensor.dtype, torch.float32))
    return norms.double().square().sum()


class CrossShardOptimizer(DenseTableOptimizer):
    """A split table's (or an FSDP-sharded vector's) layer-wise optimizer, one local shard of it
    (dense semantics).

    Subclasses give the optimizer's math in two halves: :meth:`partials` (local,
    in backward) and :meth:`complete` (with the summed statistics), both on
    :attr:`stepped`. State is kept as :class:`DenseTableOptimizer` keeps it, under
    the reference optimizer's names, so checkpoints see no difference. The step is
    open from the first half to the second (:meth:`ready`, :meth:`close`): an FP16 or
    BF16 shard steps as a float32 copy, and state kept in an annotation's
    ``state_dtype`` as float32 working copies, each rounded once when the second
    half has run: the update of the optimizer's own class on the whole table in
    float32, rounded once, as for a whole table.
    """

    # Whether a matrix split along both axes at once (dp x tp's row-parallel weights) steps exactly: its
    # statistics are whole-tensor sums, or the matrix (not factors along one axis).
    splits_both_axes = False

    @classmethod
    def on_both_axes(cls) -> type[CrossShardOptimizer] | None:
        """The form that steps a matrix split along both axes at once: this one where
        :attr:`splits_both_axes`, another form of the same optimizer, or None (refused)."""
        return cls if cls.splits_both_axes else None

    @classmethod
    def sharded_keys(cls, spec: OptimizerSpec, geometry: Geometry) -> set[str]:
        """The state entries split as the weight is (the others whole on every shard)."""
        return set(sharded_state_layouts(spec, geometry.axis, len(geometry.table_shape)))

    @classmethod
    def slot_size(cls, geometry: Geometry) -> int:
        """Floats of whole-table statistics per step; the same on every rank."""
        return 2

    @classmethod
    def step_bytes(cls, geometry: Geometry, shard_shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> int:
        """Bytes one shard of ``shard_shape`` (a ``dtype`` weight) allocates in a step beyond its
        state, at the step's peak: either outside the round, its temporaries (the shard-sized
        gradient and what is made from it) and its partial sums, or in the round, what it holds
        from one half to the other and its slot (:meth:`EndOfBackwardRound.slot_bytes`).

        An FP16 or BF16 shard steps in float32: its temporaries are float32, and its float32 copy
        is held through both halves (:func:`~overlap_optim.table_optimizer.copy_bytes`).

        Buffers the size of the batch (the touched rows' gradients and what is made from them)
        are not counted, as the planner counts none for lazy tables. ``tests/test_kernels.py`` checks
        it against the peak of a step.
        """
        return cls._math_bytes(geometry, shard_shape, math_dtype(dtype)) + copy_bytes(shard_shape, dtype)

    @classmethod
    def _math_bytes(cls, geometry: Geometry, shard_shape: tuple[int, int], dtype: torch.dtype) -> int:
        """:meth:`step_bytes` of a shard stepped in ``dtype``, beside a low-precision shard's copy."""
        slot = cls.slot_size(geometry)
        outside = cls._temporary_bytes(geometry, shard_shape, dtype) + 8 * slot
        in_round = cls._held_bytes(geometry, shard_shape, dtype) + EndOfBackwardRound.slot_bytes(slot)
        return max(outside, in_round)

    @classmethod
    def _temporary_bytes(cls, geometry: Geometry, shard_shape: tuple[int, int], dtype: torch.dtype) -> int:
        """The temporaries alive together at the step's peak outside the round, in either half
        (here, the shard-sized gradient of :meth:`whole_gradient`)."""
        return nbytes(shard_shape, dtype)

    @classmethod
    def _held_bytes(cls, geometry: Geometry, shard_shape: tuple[int, int], dtype: torch.dtype) -> int:
        """What :meth:`partials` keeps for :meth:`complete` (here, the shard-sized gradient)."""
        return nbytes(shard_shape, dtype)

    @classmethod
    def unsupported(cls, spec: OptimizerSpec, axis: int) -> str | None:
        """Why a table split along ``axis`` cannot run ``spec`` across its shards, or None. Read
        from the annotation alone, so it is refused on every rank before anything is sharded."""
        return None

    def __init__(self, weight, group: AnnotationGroup, name: str, geometry: Geometry, round_: EndOfBackwardRound) -> None:
        super().__init__(weight, group, name)
        self.geometry, self.round = geometry, round_
        self._grad: torch.Tensor | None = None
        # row_state: the entries sharded as the weight is; table_state: scalars, and the factor
        # every shard holds whole.
        self._row_keys = self.sharded_keys(group.spec, geometry)
        self._check_settings()

    @torch.no_grad()
    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """First half now; the round finishes it when backward ends. The step stays open
        (:meth:`ready`) in between: a low-precision table's float32 copy and the float32 working
        copies of low-precision state live until the second half has run."""
        state = self.ready()
        grads = grads.to(self.math_dtype)
        if self.group.spec.kwargs.get("maximize"):
            grads = -grads
        try:
            partials = self.partials(ids, grads, state, self.group.param_group)
        except BaseException:
            self._abandon()
            raise
        self.round.contribute(self.name, partials, self._second_half)

    @torch.no_grad()
    def _second_half(self, stats: torch.Tensor) -> None:
        """:meth:`complete`, then the step closed (also when it refuses: what the first half did stays,
        as it does in place on a float32 table)."""
        try:
            self.complete(stats)
        finally:
            self.close()

    def _make_placeholder(self) -> None:
        """Zeros, no step taken."""
        self._fresh_state(self.ready())
        self.close()

    def _check_settings(self) -> None:
        """Refuse settings whose cross-shard form is not built, naming the table."""

    def _fresh_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _counted_gradient(self, ids: torch.Tensor, grads: torch.Tensor, state: dict[str, Any], fresh: str) -> torch.Tensor:
        """The shard's whole gradient (:meth:`whole_gradient`), its state made fresh where it has
        no ``fresh`` entry, and its step counted: how every two-moment form's ``partials`` opens."""
        grad = self.whole_gradient(ids, grads)
        if fresh not in state:
            self._fresh_state(state)
        state["step"] += 1
        return grad

    def partials(self, ids: torch.Tensor, grads: torch.Tensor, state: dict[str, Any], hypers: dict[str, Any]) -> torch.Tensor:
        """Step the local state on the shard's gradient (``grads`` at the local rows ``ids``,
        unique; zero elsewhere) and return this shard's part of the table's statistics.
        :meth:`whole_gradient` makes the shard-sized gradient for math that needs it."""
        raise NotImplementedError

    def complete(self, stats: torch.Tensor) -> None:
        """Finish the step with the whole table's statistics (this table's slot of the round, summed)."""
        raise NotImplementedError

    def _refuse(self, what: str) -> None:
        raise ValueError(f"table {self.name!r}: {self.group.spec.name} with {what} has no cross-shard form yet; "
                         "use table_wise or data_parallel for this table")


class GatherForm(CrossShardOptimizer):
    """A form whose statistic is the whole matrix (Muon's update, GaLore's gradient): each shard writes
    its block at its offsets and zeros elsewhere (:meth:`gathered`), and the round's sum is the whole
    matrix on every rank: a gather, exact (each element is one shard's value plus zeros), at twice an
    all-gather's traffic and in float64. Any split works, both axes at once included."""

    splits_both_axes = True

    @classmethod
    def slot_size(cls, geometry):
        rows, cols = geometry.table_shape
        return rows * cols

    def gathered(self, block: torch.Tensor) -> torch.Tensor:
        """A zero matrix the whole table's shape, ``block`` (this shard's) at its offsets."""
        whole = block.new_zeros(self.geometry.table_shape)
        self.own_block(whole).copy_(block)
        return whole

    def own_block(self, whole: torch.Tensor) -> torch.Tensor:
        """This shard's block of a tensor shaped as the whole table (a view)."""
        (row, col), (rows, cols) = self.geometry.offsets, self.stepped.shape
        return whole[row : row + rows, col : col + cols]


class BlockForm(CrossShardOptimizer):
    """A factored optimizer's form on a matrix split along both axes at once (FSDP2 over tensor
    parallelism: a row-parallel weight's rows over dp, its columns over tp). A shard's rows meet only
    part of the columns, so its factors, kept whole on every shard, are known only after a round, and
    what follows from them after a second.

    The first round (``STATISTICS``) carries ``||w||^2`` and the partial sums of :meth:`partials` along
    each axis, at the shard's offsets (``1 + R + C`` floats); :meth:`between` updates the factors
    alike on every shard and returns the second round's partial sums (``SECOND_STATISTICS``,
    :meth:`second_slot_size` floats); :meth:`finish` completes the step. The step closes after it,
    or where a half refuses.
    """

    @classmethod
    def slot_size(cls, geometry: Geometry) -> int:
        rows, cols = geometry.table_shape
        return 1 + rows + cols

    @classmethod
    def second_slot_size(cls, geometry: Geometry) -> int:
        raise NotImplementedError

    def __init__(self, weight, group: AnnotationGroup, name: str, geometry: Geometry, round_: EndOfBackwardRound) -> None:
        super().__init__(weight, group, name, geometry, round_)
        self.second_round = EndOfBackwardRound(round_.process_group, phase=Phase.SECOND_STATISTICS, local=round_.local)
        self.second_round.register(name, self.second_slot_size(geometry))

    def at_offsets(self, per_row: torch.Tensor, per_col: torch.Tensor) -> torch.Tensor:
        """Whole-length row and column vectors (along their last dim), this shard's sums at its
        offsets and zeros elsewhere."""
        (rows, cols), (row, col) = self.geometry.table_shape, self.geometry.offsets
        whole = per_row.new_zeros(per_row.shape[:-1] + (rows + cols,))
        whole[..., row : row + per_row.shape[-1]] = per_row
        whole[..., rows + col : rows + col + per_col.shape[-1]] = per_col
        return whole

    def local_block(self, row_vector: torch.Tensor, col_vector: torch.Tensor) -> torch.Tensor:
        """``row_vector[i] * col_vector[j]`` over this shard's rows and columns."""
        (row, col), (rows, cols) = self.geometry.offsets, self.stepped.shape
        return row_vector[row : row + rows, None] * col_vector[None, col : col + cols]

    def _second_half(self, stats: torch.Tensor) -> None:
        try:
            self.second_round.contribute(self.name, self.between(stats), self._last_half)
            self.second_round.arm()
        except BaseException:
            self.close()
            raise

    def _last_half(self, stats: torch.Tensor) -> None:
        try:
            self.finish(stats)
        finally:
            self.close()

    def between(self, stats: torch.Tensor) -> torch.Tensor:
        """The factors from the first round's sums; the second round's partial sums."""
        raise NotImplementedError

    def finish(self, stats: torch.Tensor) -> None:
        """The step, from the second round's sums."""
        raise NotImplementedError
