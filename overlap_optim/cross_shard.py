"""Cross-shard optimizers: layer-wise optimizers on a tensor split across ranks, whole-tensor
statistics in one all-reduce per step.

LAMB and LARS scale an update by a trust ratio of whole-tensor norms; Adafactor and
CAME by the RMS of the whole update and factored second moments; Muon orthogonalises
the whole update (its "statistics" are the whole matrix: a gather). On a tensor split
into row or column shards (a table under ``sharders``, a parameter under FSDP2), no
shard can compute those alone, so the optimizer model finds these optimizers not
separable. For the classes in :data:`CROSS_SHARD` the split still steps exactly:

1. In backward, each shard runs the first half of the update on its own rows
   or columns (moments, weight decay, the raw update) and writes the partial
   sums the second half needs (``||w||^2``, ``||u||^2`` ...) into its tensor's
   slot of one flat buffer.
2. When backward ends, an end-of-backward round
   (:class:`overlap_optim.round.EndOfBackwardRound`) sums that buffer across
   ranks in **one all-reduce**: the slots of every such tensor travel together,
   so one tensor or forty cost the same one collective per step.
3. Each shard finishes its update with the whole-tensor statistics.

The result is the unsharded optimizer's, with dense semantics (every row
steps, untouched rows of a table on a zero gradient).

Every rank takes part in the round in the same order, a rank that holds an
empty shard included: it contributes zeros for what it does not hold.

A vector (a bias under FSDP2, split along its only dim) steps the same way with the
optimizer's own 1-D update: Adafactor and CAME keep an unfactored second moment
there, so only the RMS of the weight and of the update are whole-vector
statistics; LAMB needs its two norms; LARS, as its package does, scales no
vector, and its slot is empty. Muon, like torch's, steps matrices only.

:class:`CrossShardOptimizer` and its subclasses are the per-shard math, one per
optimizer class; ``sharders.cross_shard`` builds them for table shards and
:mod:`overlap_optim.fsdp` for FSDP2's parameter shards.

:data:`CROSS_SHARD` is a plain dict ``optimizer class -> implementation`` for
matrices, :data:`CROSS_SHARD_VECTOR` the same for vectors.
Classes from optional packages (pytorch-optimizer, came-pytorch) are added only
when the user's code has imported that package; the core imports none of them.
"""


from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from overlap_optim import _private
from overlap_optim.round import EndOfBackwardRound
from overlap_optim.spec import AnnotationGroup, OptimizerSpec
from overlap_optim.table_optimizer import DenseTableOptimizer, copy_bytes, math_dtype

__all__ = [
    "CROSS_SHARD", "CROSS_SHARD_VECTOR", "cross_shard_class", "Geometry", "CrossShardOptimizer",
    "sharded_state_layouts",
]

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
    entries shaped as the vector, "element", measured on a stand-in (the optimizer's 1-D state
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


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def _square_norm(tensor: torch.Tensor) -> torch.Tensor:
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
        are not counted, as the planner counts none for lazy tables. Measured against the peak
        of a step in ``tests/test_kernels.py``.
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
        return _nbytes(shard_shape, dtype)

    @classmethod
    def _held_bytes(cls, geometry: Geometry, shard_shape: tuple[int, int], dtype: torch.dtype) -> int:
        """What :meth:`partials` keeps for :meth:`complete` (here, the shard-sized gradient)."""
        return _nbytes(shard_shape, dtype)

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
        self._row_keys = set(sharded_state_layouts(group.spec, geometry.axis, len(geometry.table_shape)))
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


class LambTable(CrossShardOptimizer):
    """pytorch-optimizer's ``Lamb``: Adam moments, then the trust ratio ``||w|| / ||u||``; the same
    on a vector."""

    @classmethod
    def _temporary_bytes(cls, geometry, shard_shape, dtype):
        # the gradient, the update, and the square of the weight, then of the update, for their norms
        return 3 * _nbytes(shard_shape, dtype)

    @classmethod
    def _held_bytes(cls, geometry, shard_shape, dtype):
        return _nbytes(shard_shape, dtype)  # the update

    def _check_settings(self) -> None:
        h, kwargs = self.group.param_group, self.group.spec.kwargs
        for key in ("rectify", "adanorm", "pre_norm"):
            if h.get(key) or kwargs.get(key):
                self._refuse(f"{key}=True")

    def _fresh_state(self, state):
        state["exp_avg"] = torch.zeros_like(self.stepped)
        state["exp_avg_sq"] = torch.zeros_like(self.stepped)
        for name in ("weight_norm", "adam_norm", "trust_ratio"):
            state[name] = self.stepped.new_zeros(())
        state["step"] = 0

    def partials(self, ids, grads, state, h):
        grad = self.whole_gradient(ids, grads)
        if "exp_avg" not in state:
            self._fresh_state(state)
        state["step"] += 1
        beta1, beta2 = h["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1 if h["grad_averaging"] else 1.0)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if h["weight_decay"] != 0 and h["weight_decouple"]:
            self.stepped.mul_(1.0 - h["weight_decay"] * (1.0 if h["fixed_decay"] else h["lr"]))
        update = exp_avg_sq.sqrt().add_(h["eps"])
        torch.div(exp_avg, update, out=update)
        if not h["weight_decouple"] and h["weight_decay"] > 0:
            update.add_(self.stepped, alpha=h["weight_decay"])
        self._grad = update
        return torch.stack([self.stepped.square().sum(), update.square().sum()]).double()

    def complete(self, stats):
        h, state = self.group.param_group, self._optimizer.state[self.stepped]
        weight_norm = stats[0].sqrt().clamp(min=0, max=10.0).to(self.stepped.dtype)  # Lamb.clamp
        update_norm = stats[1].sqrt().to(self.stepped.dtype)
        trust = torch.ones_like(weight_norm) if weight_norm == 0 or update_norm == 0 else weight_norm / (
            update_norm + h["eps"])
        state["weight_norm"], state["adam_norm"], state["trust_ratio"] = weight_norm, update_norm, trust
        if h["adam"]:
            trust = 1.0
        beta1 = h["betas"][0]
        step_size = h["lr"] if h.get("adam_debias") else h["lr"] / (1.0 - beta1 ** state["step"])
        self.stepped.add_(self._grad, alpha=-step_size * float(trust))
        self._grad = None


class AdafactorTable(CrossShardOptimizer):
    """``torch.optim.Adafactor`` on a 2-D table: factored second moments, the RMS of the weight
    and of the update.

    The row factor ``row_var`` (R, 1) and the column factor ``col_var`` (1, C) are kept
    where they are whole: on row shards, ``row_var`` holds the shard's rows and every rank
    holds all of ``col_var``; on column shards, the reverse. One round carries ``||w||^2``,
    the partial sums of ``g^2`` along the split axis, ``sum(row_var)`` and the partial sums
    of ``g^2 / row_var`` (or ``/ col_var``), from which the update's RMS follows without a
    second round: with ``M = max(mean(row_var), eps1)``, ``||u||^2 = M * sum_j A_j / col_var_j``,
    ``A_j = sum_i g_ij^2 / row_var_i`` (row shards; the transpose on column shards). That
    identity needs Adafactor's variance floor ``eps1**2`` not to bind on an element with a
    nonzero gradient; when it does, the next step raises on every rank, naming the table.

    Apart from the weight's norm and its weight decay, the step costs the touched rows, not
    the shard: an untouched row's gradient is zero, so it adds nothing to the sums and its
    update is zero (on column shards every row is local, and the same holds per row). No
    temporary is the shard's size: the largest are the row factor's update on row shards,
    and the slot of the round (whose size is the unsplit axis's, twice). :meth:`step_bytes`
    counts those, not the touched rows' buffers (the batch's size), as the planner counts
    none for lazy tables.
    """

    @classmethod
    def slot_size(cls, geometry):
        rows, cols = geometry.table_shape
        return 3 + 2 * (cols if geometry.axis == 0 else rows)

    @classmethod
    def _temporary_bytes(cls, geometry, shard_shape, dtype):
        # Row shards: the row factor's new values, whole (zeros at untouched rows). Column shards,
        # in the second half: beside the partial sums, the summed buffer, and three float64 vectors
        # of the rows (the row factor, the sums over it, where it is positive).
        if geometry.axis == 0:
            return _nbytes(shard_shape[:1], dtype)
        return 8 * cls.slot_size(geometry) + 3 * _nbytes(shard_shape[:1], torch.float64)

    @classmethod
    def _held_bytes(cls, geometry, shard_shape, dtype):
        return 0  # the touched rows and their gradients: the batch's size

    def _check_settings(self):
        self._floor_bound = False
        self._touched: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, grads) between the halves

    def _fresh_state(self, state):
        (rows, cols), local = self.geometry.table_shape, self.stepped.shape
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["row_var"] = self.stepped.new_zeros(local[0] if self.geometry.axis == 0 else rows, 1)
        state["col_var"] = self.stepped.new_zeros(1, local[1] if self.geometry.axis == 1 else cols)

    def partials(self, ids, grads, state, h):
        # Untouched rows have a zero gradient: they add nothing to the sums, their factor
        # entries decay, and their update is zero. Only the weight's norm and the weight
        # decay pass over the whole shard; the rest follows the touched rows.
        if "row_var" not in state:
            self._fresh_state(state)
        state["step"] += 1
        beta = float(state["step"]) ** h["beta2_decay"]
        rows, cols = self.geometry.table_shape
        square = grads * grads
        weight_sq = _square_norm(self.stepped)  # before weight decay
        if h["weight_decay"] != 0:
            self.stepped.mul_(1 - h["lr"] * h["weight_decay"])
        self._touched = ids, grads
        flag = torch.tensor(float(self._floor_bound), dtype=torch.float64)
        if self.geometry.axis == 0:  # whole rows here: the row factor is local
            row_var = state["row_var"]
            row_var.lerp_(torch.zeros_like(row_var).index_copy_(0, ids, square.sum(1, keepdim=True) / cols), beta)
            touched = row_var.index_select(0, ids)
            a = torch.where(touched > 0, square / touched, 0).sum(0)
            return torch.cat([weight_sq[None], row_var.double().sum()[None], flag[None],
                              square.sum(0).double(), a.double()])
        state["col_var"].lerp_(square.sum(0, keepdim=True) / rows, beta)
        col_var = state["col_var"]
        per_row = weight_sq.new_zeros(2, rows)  # sum_j g_ij^2 and sum_j g_ij^2 / col_var_j, zero where untouched
        per_row[0].index_copy_(0, ids, square.sum(1).double())
        per_row[1].index_copy_(0, ids, torch.where(col_var > 0, square / col_var, 0).sum(1).double())
        return torch.cat([weight_sq[None], torch.zeros(1, dtype=torch.float64), flag[None], per_row.flatten()])

    def complete(self, stats):
        h, state = self.group.param_group, self._optimizer.state[self.stepped]
        if stats[2] > 0:
            raise ValueError(
                f"table {self.name!r}: at the last step Adafactor's variance floor eps1**2 bound an element "
                "with a nonzero gradient on some shard, where the cross-shard RMS of the update is not exact; "
                "use table_wise or data_parallel for this table, or a smaller eps[0]"
            )
        rows, cols = self.geometry.table_shape
        eps1 = h["eps"][0] if h["eps"][0] is not None else torch.finfo(self.stepped.dtype).eps
        beta = float(state["step"]) ** h["beta2_decay"]
        n = (stats.numel() - 3) // 2
        summed, over = stats[3 : 3 + n], stats[3 + n :]
        if self.geometry.axis == 0:
            state["col_var"].lerp_((summed / rows).to(self.stepped.dtype)[None, :], beta)
            mean_row = float(stats[1]) / rows
            other = state["col_var"][0].double()
        else:
            state["row_var"].lerp_((summed / cols).to(self.stepped.dtype)[:, None], beta)
            mean_row = float(state["row_var"].double().mean())
            other = state["row_var"][:, 0].double()
        floor = max(mean_row, eps1)
        ids, grads = self._touched
        estimate = (state["row_var"].index_select(0, ids) @ state["col_var"]).div_(floor)
        self._floor_bound = bool(((estimate < eps1 * eps1) & (grads != 0)).any())
        update = estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grads)
        update_sq = floor * float(torch.where(other > 0, over / other, 0).sum())
        denom = max(1.0, update_sq**0.5 / ((rows * cols) ** 0.5 * h["d"]))
        step = float(state["step"])
        alpha = max(h["eps"][1], float(stats[0]) ** 0.5 / (rows * cols) ** 0.5) * min(h["lr"], 1 / step**0.5)
        self.stepped.index_add_(0, ids, update, alpha=-alpha / denom)
        self._touched = None


class AdafactorVector(CrossShardOptimizer):
    """``torch.optim.Adafactor`` on a vector: not factored, a ``variance`` per element (sharded as
    the vector is). The update ``g / sqrt(variance)`` is element-wise; the round carries the
    two whole-vector statistics, ``||w||^2`` (before weight decay: the step size follows the
    weight's RMS) and ``||u||^2`` (the update's RMS, clipped to ``d``)."""

    def _fresh_state(self, state):
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["variance"] = torch.zeros_like(self.stepped)

    def partials(self, ids, grads, state, h):
        grad = self.whole_gradient(ids, grads)
        if "variance" not in state:
            self._fresh_state(state)
        state["step"] += 1
        weight_sq = torch.linalg.vector_norm(self.stepped, dtype=torch.float64).square()
        if h["weight_decay"] != 0:
            self.stepped.mul_(1 - h["lr"] * h["weight_decay"])
        state["variance"].lerp_(grad * grad, float(state["step"]) ** h["beta2_decay"])
        eps1 = h["eps"][0] if h["eps"][0] is not None else torch.finfo(self.stepped.dtype).eps
        self._grad = state["variance"].clamp(min=eps1 * eps1).rsqrt_().mul_(grad)
        return torch.stack([weight_sq, torch.linalg.vector_norm(self._grad, dtype=torch.float64).square()])

    def complete(self, stats):
        h, state = self.group.param_group, self._optimizer.state[self.stepped]
        root = self.geometry.numel**0.5
        alpha = max(h["eps"][1], float(stats[0]) ** 0.5 / root) * min(h["lr"], 1 / float(state["step"]) ** 0.5)
        denom = max(1.0, float(stats[1]) ** 0.5 / (root * h["d"]))
        self.stepped.add_(self._grad, alpha=-alpha / denom)
        self._grad = None


class CameTable(CrossShardOptimizer):
    """came-pytorch's ``CAME``: Adafactor's factored second moment, then a factored confidence
    (the residual ``(u - m)^2``) that scales the momentum.

    The residual's means along the split axis need the update, which needs the round's
    statistics: a second round, unless expanded. With ``u = k * s * h`` (``k`` the clipping
    factor, ``s`` the reduced factor of the unsplit... split axis, ``h = g / sqrt(local factor)``)
    and ``u - m_new = beta1 (u - m_old)``, the sum of the residual along the split axis is
    ``beta1^2 (k^2 s^2 sum h^2 - 2 k s sum h m_old + sum m_old^2)`` plus the eps terms: three
    partial sums per column (row shards) or per row (column shards), in the same round.
    """

    @classmethod
    def slot_size(cls, geometry):
        rows, cols = geometry.table_shape
        return 3 + 4 * cols if geometry.axis == 0 else 1 + 4 * rows

    @classmethod
    def _temporary_bytes(cls, geometry, shard_shape, dtype):
        # In the first half: the gradient, its square, the square plus eps1; the old momentum, the
        # gradient over the local factor and one product of them (for a partial sum), in float64.
        return 3 * _nbytes(shard_shape, dtype) + 3 * _nbytes(shard_shape, torch.float64)

    @classmethod
    def _held_bytes(cls, geometry, shard_shape, dtype):
        return _nbytes(shard_shape, dtype)  # the gradient

    def _fresh_state(self, state):
        (rows, cols), (local_rows, local_cols) = self.geometry.table_shape, self.stepped.shape
        own_rows = local_rows if self.geometry.axis == 0 else rows
        own_cols = local_cols if self.geometry.axis == 1 else cols
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(self.stepped)
        state["exp_avg_sq_row"] = self.stepped.new_zeros(own_rows)
        state["exp_avg_sq_col"] = self.stepped.new_zeros(own_cols)
        state["exp_avg_res_row"] = self.stepped.new_zeros(own_rows)
        state["exp_avg_res_col"] = self.stepped.new_zeros(own_cols)
        state["RMS"] = self.stepped.new_zeros(())

    def partials(self, ids, grads, state, h):
        grad = self.whole_gradient(ids, grads)
        if "exp_avg" not in state:
            self._fresh_state(state)
        state["step"] += 1
        beta2, (eps1, _) = h["betas"][1], h["eps"]
        square = grad * grad
        sq = square + eps1
        weight_sq = _square_norm(self.stepped)[None]
        m_old = state["exp_avg"].double()
        self._grad = grad
        if self.geometry.axis == 0:  # whole rows here: the row factor is local
            row = state["exp_avg_sq_row"]
            row.mul_(beta2).add_(sq.mean(dim=-1), alpha=1.0 - beta2)
            h_ = grad.double() / row.double().sqrt()[:, None]
            return torch.cat([weight_sq, row.double().sum()[None], state["exp_avg_res_row"].double().sum()[None],
                              sq.double().sum(0), (h_ * h_).sum(0), (h_ * m_old).sum(0), (m_old * m_old).sum(0)])
        col = state["exp_avg_sq_col"]
        col.mul_(beta2).add_(sq.mean(dim=-2), alpha=1.0 - beta2)
        k = grad.double() / col.double().sqrt()[None, :]
        return torch.cat([weight_sq, sq.double().sum(1), (k * k).sum(1), (k * m_old).sum(1), (m_old * m_old).sum(1)])

    def complete(self, stats):
        h, state = self.group.param_group, self._optimizer.state[self.stepped]
        (beta1, beta2, beta3), (_, eps2) = h["betas"], h["eps"]
        rows, cols = self.geometry.table_shape
        state["RMS"] = (stats[0] / (rows * cols)).sqrt().to(self.stepped.dtype)
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        if self.geometry.axis == 0:
            summed, h2, hm, m2 = stats[3:].view(4, cols)
            col.mul_(beta2).add_((summed / rows).to(col.dtype), alpha=1.0 - beta2)
            mean_row = float(stats[1]) / rows
            factor = (mean_row / col.double()).sqrt()  # s_j: per column
        else:
            summed, h2, hm, m2 = stats[1:].view(4, rows)
            row.mul_(beta2).add_((summed / cols).to(row.dtype), alpha=1.0 - beta2)
            mean_row = float(row.double().mean())
            factor = (mean_row / row.double()).sqrt()  # t_i: per row
        update_sq = float((factor * factor * h2).sum())
        clip = 1.0 / max((update_sq / (rows * cols)) ** 0.5 / h["clip_threshold"], 1.0)
        update = ((row / mean_row).rsqrt_()[:, None] * col.rsqrt()[None, :]).mul_(self._grad).mul_(clip)
        exp_avg = state["exp_avg"]
        exp_avg.mul_(beta1).add_(update, alpha=1 - beta1)
        res = (update - exp_avg) ** 2 + eps2
        res_row, res_col = state["exp_avg_res_row"], state["exp_avg_res_col"]
        across = beta1**2 * (clip * clip * factor * factor * h2 - 2 * clip * factor * hm + m2)  # along the split axis
        if self.geometry.axis == 0:
            old_row_sum = float(stats[2])
            res_row.mul_(beta3).add_(res.mean(dim=-1), alpha=1.0 - beta3)
            res_col.mul_(beta3).add_((across / rows + eps2).to(res_col.dtype), alpha=1.0 - beta3)
            mean_res_row = (beta3 * old_row_sum + (1.0 - beta3) * float((across + rows * eps2).sum()) / cols) / rows
        else:
            res_col.mul_(beta3).add_(res.mean(dim=-2), alpha=1.0 - beta3)
            res_row.mul_(beta3).add_((across / cols + eps2).to(res_row.dtype), alpha=1.0 - beta3)
            mean_res_row = float(res_row.double().mean())
        step = (res_row / mean_res_row).rsqrt_()[:, None] * res_col.rsqrt()[None, :] * exp_avg
        if h["weight_decay"] != 0:
            self.stepped.add_(self.stepped, alpha=-h["weight_decay"] * h["lr"])
        self.stepped.add_(-(step * h["lr"]))
        self._grad = None


class CameVector(CrossShardOptimizer):
    """came-pytorch's ``CAME`` on a vector: not factored, ``exp_avg_sq`` per element, and no
    confidence factor (the step is the momentum itself). The round carries ``||w||^2`` (the
    ``RMS`` it keeps) and ``||u||^2`` (the update's RMS, clipped to ``clip_threshold``)."""

    def _fresh_state(self, state):
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(self.stepped)
        state["exp_avg_sq"] = torch.zeros_like(self.stepped)
        state["RMS"] = self.stepped.new_zeros(())

    def partials(self, ids, grads, state, h):
        grad = self.whole_gradient(ids, grads)
        if "exp_avg" not in state:
            self._fresh_state(state)
        state["step"] += 1
        beta2 = h["betas"][1]
        state["exp_avg_sq"].mul_(beta2).add_(grad * grad + h["eps"][0], alpha=1.0 - beta2)
        self._grad = state["exp_avg_sq"].rsqrt().mul_(grad)
        weight_sq = torch.linalg.vector_norm(self.stepped, dtype=torch.float64).square()
        return torch.stack([weight_sq, torch.linalg.vector_norm(self._grad, dtype=torch.float64).square()])

    def complete(self, stats):
        h, state = self.group.param_group, self._optimizer.state[self.stepped]
        numel, beta1 = self.geometry.numel, h["betas"][0]
        state["RMS"] = (stats[0] / numel).sqrt().to(self.stepped.dtype)
        update = self._grad.div_(max(float(stats[1] / numel) ** 0.5 / h["clip_threshold"], 1.0))
        state["exp_avg"].mul_(beta1).add_(update, alpha=1 - beta1)
        if h["weight_decay"] != 0:
            self.stepped.add_(self.stepped, alpha=-h["weight_decay"] * h["lr"])
        self.stepped.add_(-(state["exp_avg"] * h["lr"]))
        self._grad = None


class LarsTable(CrossShardOptimizer):
    """pytorch-optimizer's ``LARS``: the trust ratio ``c ||w|| / (||g|| + wd ||w||)``, then momentum.
    On a vector, as its package does, plain SGD with momentum (no trust ratio, no weight decay):
    element-wise, an empty slot."""

    @classmethod
    def slot_size(cls, geometry):
        return 2 if len(geometry.table_shape) > 1 else 0

    @classmethod
    def _temporary_bytes(cls, geometry, shard_shape, dtype):
        # In the second half: the gradient, the scaled gradient, and the momentum's copy (one
        # fewer without momentum, or with Nesterov's: the count is the larger)
        return 3 * _nbytes(shard_shape, dtype)

    def _fresh_state(self, state):
        if self.group.param_group["momentum"] > 0:
            state["momentum_buffer"] = torch.zeros_like(self.stepped)
        state["step"] = 0

    def partials(self, ids, grads, state, h):
        grad = self.whole_gradient(ids, grads)
        if not state:
            self._fresh_state(state)
        state["step"] += 1
        self._grad = grad
        if self.stepped.dim() == 1:
            return grad.new_zeros(0, dtype=torch.float64)
        return torch.stack([self.stepped.square().sum(), grad.square().sum()]).double()

    def complete(self, stats):
        h, state = self.group.param_group, self._optimizer.state[self.stepped]
        grad = self._grad if self.stepped.dim() == 1 else self._scaled(stats, h)
        if h["momentum"] > 0:
            buffer = state["momentum_buffer"]
            buffer.mul_(h["momentum"]).add_(grad, alpha=1.0 - h["dampening"])
            grad = grad.add_(buffer, alpha=h["momentum"]) if h["nesterov"] else buffer.clone()
        self.stepped.add_(grad, alpha=-h["lr"])
        self._grad = None

    def _scaled(self, stats: torch.Tensor, h: dict[str, Any]) -> torch.Tensor:
        """A matrix's gradient, weight decay added, scaled by the trust ratio of the whole-tensor norms."""
        param_norm, update_norm = stats[0].sqrt().float(), stats[1].sqrt().float()
        denominator = update_norm + h["weight_decay"] * param_norm
        trust = h["trust_coefficient"] * param_norm / denominator if param_norm > 0 and denominator > 0 else 1.0
        return self._grad.add(self.stepped, alpha=h["weight_decay"]).mul_(trust)


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


class MuonTable(CrossShardOptimizer):
    """``torch.optim.Muon``: momentum on each shard, then Newton-Schulz on the whole matrix.

    No statistic short of the matrix itself will do for the orthogonalisation, so the
    slot is the whole matrix: each shard writes its momentum-corrected update at its own
    offsets and zeros elsewhere, the round's all-reduce sums those into the whole update
    on every rank (a gather, exact, at twice an all-gather's traffic and in float64), and
    each rank orthogonalises it with torch's own Newton-Schulz and keeps its block. Every
    rank computes the whole orthogonalisation; its cost and the gather's are measured in
    ``benchmarks/fsdp.py``.
    """

    @classmethod
    def slot_size(cls, geometry):
        rows, cols = geometry.table_shape
        return rows * cols

    @classmethod
    def _math_bytes(cls, geometry, shard_shape, dtype):
        """The round's slot at its peak: the whole matrix contributed in ``dtype``, and in float64 the
        buffer, a copy and the sum (28 bytes an element of the table, for float32). Outside the
        round, the shard's gradient, its Nesterov update and the matrix are less; so are, in the
        second half, the matrix in ``dtype`` and the orthogonalisation's bfloat16 copies beside
        the slot."""
        outside = 2 * _nbytes(shard_shape, dtype) + _nbytes(geometry.table_shape, dtype)
        return max(outside, EndOfBackwardRound.slot_bytes(cls.slot_size(geometry), dtype))

    def _fresh_state(self, state):
        state["momentum_buffer"] = torch.zeros_like(self.stepped)

    def partials(self, ids, grads, state, h):
        grad = self.whole_gradient(ids, grads)
        if "momentum_buffer" not in state:
            self._fresh_state(state)
        buffer = state["momentum_buffer"]
        buffer.lerp_(grad, 1 - h["momentum"])
        update = grad.lerp(buffer, h["momentum"]) if h["nesterov"] else buffer
        whole = update.new_zeros(self.geometry.table_shape)
        self._block(whole).copy_(update)
        return whole

    def complete(self, stats):
        h, shape = self.group.param_group, self.geometry.table_shape
        whole = stats.view(shape).to(self.stepped.dtype)
        ortho = _private.muon_orthogonalized(whole, h["ns_coefficients"], h["ns_steps"], h["eps"])
        self.stepped.mul_(1 - h["lr"] * h["weight_decay"])
        lr = _private.muon_adjusted_lr(h["lr"], h["adjust_lr_fn"], torch.Size(shape))
        self.stepped.add_(self._block(ortho), alpha=-lr)

    def _block(self, whole: torch.Tensor) -> torch.Tensor:
        """This shard's block of a table-shaped tensor."""
        (row, col), (rows, cols) = self.geometry.offsets, self.stepped.shape
        return whole[row : row + rows, col : col + cols]


# optimizer class -> its cross-shard implementation on a matrix, and on a vector (Muon, as
# torch's, steps matrices only). Classes of optional packages are looked up by name in
# _OPTIONAL, once their package is imported (the core never imports them).
CROSS_SHARD: dict[type, type[CrossShardOptimizer]] = {
    torch.optim.Adafactor: AdafactorTable, torch.optim.Muon: MuonTable, RowWiseAdagrad: RowWiseAdagradTable,
}
CROSS_SHARD_VECTOR: dict[type, type[CrossShardOptimizer]] = {torch.optim.Adafactor: AdafactorVector}
_OPTIONAL = {  # (package, class name) -> (matrix form, vector form)
    ("pytorch_optimizer", "Lamb"): (LambTable, LambTable),
    ("pytorch_optimizer", "LARS"): (LarsTable, LarsTable),
    ("came_pytorch", "CAME"): (CameTable, CameVector),
}


def cross_shard_class(optimizer_class: type, ndim: int = 2) -> type[CrossShardOptimizer] | None:
    """The implementation for ``optimizer_class`` on a tensor of ``ndim`` dims (2: a table or
    matrix, 1: a vector), or None: it stays refused on such a tensor split across ranks."""
    if ndim not in (1, 2):
        return None
    found = (CROSS_SHARD if ndim == 2 else CROSS_SHARD_VECTOR).get(optimizer_class)
    if found is not None:
        return found
    for (package, name), forms in _OPTIONAL.items():
        module = sys.modules.get(package)
        if module is not None and getattr(module, name, None) is optimizer_class:
            return forms[2 - ndim]
    return None


