"""``torch.optim.Adafactor`` across shards: :class:`AdafactorTable` on a table or matrix split
along rows or columns, :class:`AdafactorVector` on a vector (an FSDP2-sharded bias).

On a table, the factored second moments ``row_var`` (R, 1) and ``col_var`` (1, C) are kept
where they are whole: the factor along the split axis sharded as the weight, the other whole
on every shard. On a vector, as torch's, a ``variance`` per element, sharded as the vector.

Per step, one slot in the ``STATISTICS`` round, summed across ranks:

- a table: ``||w||^2`` (before weight decay), ``sum(row_var)`` (row shards), a flag that the
  variance floor ``eps1**2`` bound on some shard, and along the unsplit axis the partial sums
  of ``g^2`` and of ``g^2`` over the local factor: ``3 + 2 C`` floats (row shards) or
  ``3 + 2 R`` (column shards). Once the floor has bound, the next step raises on every rank,
  naming the table;
- a vector: ``||w||^2`` and ``||u||^2``, 2 floats.
"""

from __future__ import annotations

import torch

from overlap_optim.cross_shard_base import BlockForm, CrossShardOptimizer, nbytes, square_norm

__all__ = ["AdafactorTable", "AdafactorBlock", "AdafactorVector"]


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
    def on_both_axes(cls):
        return AdafactorBlock

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
            return nbytes(shard_shape[:1], dtype)
        return 8 * cls.slot_size(geometry) + 3 * nbytes(shard_shape[:1], torch.float64)

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
        weight_sq = square_norm(self.stepped)  # before weight decay
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


class AdafactorBlock(BlockForm):
    """``torch.optim.Adafactor`` on a matrix split along both axes at once (:class:`BlockForm`):
    ``row_var`` (R, 1) and ``col_var`` (1, C) whole on every shard. The first round sums ``g^2`` along
    each axis; every shard then updates both factors alike and forms its update, and the second sums
    ``||u||^2`` (1 float). The update is torch's, variance floor included.
    """

    @classmethod
    def second_slot_size(cls, geometry):
        return 1

    @classmethod
    def sharded_keys(cls, spec, geometry):
        return set()  # both factors whole on every shard

    def _fresh_state(self, state):
        rows, cols = self.geometry.table_shape
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["row_var"] = self.stepped.new_zeros(rows, 1)
        state["col_var"] = self.stepped.new_zeros(1, cols)

    def partials(self, ids, grads, state, h):
        grad = self._counted_gradient(ids, grads, state, "row_var")
        weight_sq = square_norm(self.stepped)  # before weight decay
        if h["weight_decay"] != 0:
            self.stepped.mul_(1 - h["lr"] * h["weight_decay"])
        self._grad = grad
        square = (grad * grad).double()
        return torch.cat([weight_sq[None], self.at_offsets(square.sum(1), square.sum(0))])

    def between(self, stats):
        h, state = self.group.param_group, self._optimizer.state[self.stepped]
        rows, cols = self.geometry.table_shape
        beta = float(state["step"]) ** h["beta2_decay"]
        eps1 = h["eps"][0] if h["eps"][0] is not None else torch.finfo(self.stepped.dtype).eps
        state["row_var"].lerp_((stats[1 : 1 + rows] / cols).to(self.stepped.dtype)[:, None], beta)
        state["col_var"].lerp_((stats[1 + rows :] / rows).to(self.stepped.dtype)[None, :], beta)
        floor = max(float(state["row_var"].double().mean()), eps1)
        estimate = self.local_block(state["row_var"][:, 0], state["col_var"][0]).div_(floor)
        self._update = estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(self._grad)
        step = float(state["step"])
        self._alpha = max(h["eps"][1], float(stats[0]) ** 0.5 / (rows * cols) ** 0.5) * min(h["lr"], 1 / step**0.5)
        self._grad = None
        return self._update.double().square().sum().reshape(1)

    def finish(self, stats):
        rows, cols = self.geometry.table_shape
        denom = max(1.0, float(stats[0]) ** 0.5 / ((rows * cols) ** 0.5 * self.group.param_group["d"]))
        self.stepped.add_(self._update, alpha=-self._alpha / denom)
        self._update = None


class AdafactorVector(CrossShardOptimizer):
    """``torch.optim.Adafactor`` on a vector: not factored, a ``variance`` per element (sharded as
    the vector is). The update ``g / sqrt(variance)`` is element-wise; the round carries the
    two whole-vector statistics, ``||w||^2`` (before weight decay: the step size follows the
    weight's RMS) and ``||u||^2`` (the update's RMS, clipped to ``d``)."""

    def _fresh_state(self, state):
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["variance"] = torch.zeros_like(self.stepped)

    def partials(self, ids, grads, state, h):
        grad = self._counted_gradient(ids, grads, state, "variance")
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
