"""came-pytorch's ``CAME`` across shards: :class:`CameTable` on a table or matrix split along
rows or columns, :class:`CameVector` on a vector (an FSDP2-sharded bias).

On a table: Adafactor's factored second moment, then a factored confidence (the residual
``(u - m)^2``) that scales the momentum; the factors along the split axis are sharded as the
weight, the others whole on every shard. On a vector, as its package does: ``exp_avg_sq``
per element and no confidence factor.

Per step, one slot in the ``STATISTICS`` round, summed across ranks:

- a table: ``||w||^2``, and along the unsplit axis the partial sums of ``g^2 + eps1`` and the
  three that expand the residual's means (``sum h^2``, ``sum h m_old``, ``sum m_old^2``, ``h``
  the gradient over the local factor); on row shards also the sums of the row factor and of
  the residual's row factor: ``3 + 4 C`` floats (row shards) or ``1 + 4 R`` (column shards);
- a vector: ``||w||^2`` and ``||u||^2``, 2 floats.
"""

from __future__ import annotations

import torch

from overlap_optim.cross_shard_base import BlockForm, CrossShardOptimizer, nbytes, square_norm

__all__ = ["CameTable", "CameBlock", "CameVector"]


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
    def on_both_axes(cls):
        return CameBlock

    @classmethod
    def slot_size(cls, geometry):
        rows, cols = geometry.table_shape
        return 3 + 4 * cols if geometry.axis == 0 else 1 + 4 * rows

    @classmethod
    def _temporary_bytes(cls, geometry, shard_shape, dtype):
        # In the first half: the gradient, its square, the square plus eps1; the old momentum, the
        # gradient over the local factor and one product of them (for a partial sum), in float64.
        return 3 * nbytes(shard_shape, dtype) + 3 * nbytes(shard_shape, torch.float64)

    @classmethod
    def _held_bytes(cls, geometry, shard_shape, dtype):
        return nbytes(shard_shape, dtype)  # the gradient

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
        grad = self._counted_gradient(ids, grads, state, "exp_avg")
        beta2, (eps1, _) = h["betas"][1], h["eps"]
        square = grad * grad
        sq = square + eps1
        weight_sq = square_norm(self.stepped)[None]
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


class CameBlock(BlockForm):
    """came-pytorch's ``CAME`` on a matrix split along both axes at once (:class:`BlockForm`): every
    factor whole on every shard, the momentum sharded as the weight. The first round sums
    ``g^2 + eps1`` along each axis; every shard then updates both second-moment factors alike and
    forms its unclipped update ``u``. The second sums ``||u||^2`` and, per row and per column, the
    three sums that expand the residual's means (``sum u^2``, ``sum u m_old``, ``sum m_old^2``:
    ``1 + 3 R + 3 C`` floats), as :class:`CameTable` expands them along its split axis.
    """

    @classmethod
    def second_slot_size(cls, geometry):
        rows, cols = geometry.table_shape
        return 1 + 3 * (rows + cols)

    @classmethod
    def sharded_keys(cls, spec, geometry):
        return {"exp_avg"}  # the factors whole on every shard

    def _fresh_state(self, state):
        rows, cols = self.geometry.table_shape
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(self.stepped)
        for name, size in (("exp_avg_sq_row", rows), ("exp_avg_sq_col", cols), ("exp_avg_res_row", rows),
                           ("exp_avg_res_col", cols)):
            state[name] = self.stepped.new_zeros(size)
        state["RMS"] = self.stepped.new_zeros(())

    def partials(self, ids, grads, state, h):
        grad = self._counted_gradient(ids, grads, state, "exp_avg")
        sq = (grad * grad + h["eps"][0]).double()
        self._grad = grad
        return torch.cat([square_norm(self.stepped)[None], self.at_offsets(sq.sum(1), sq.sum(0))])

    def between(self, stats):
        h, state = self.group.param_group, self._optimizer.state[self.stepped]
        beta2 = h["betas"][1]
        rows, cols = self.geometry.table_shape
        state["RMS"] = (stats[0] / (rows * cols)).sqrt().to(self.stepped.dtype)
        sq_row, sq_col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        sq_row.mul_(beta2).add_((stats[1 : 1 + rows] / cols).to(sq_row.dtype), alpha=1.0 - beta2)
        sq_col.mul_(beta2).add_((stats[1 + rows :] / rows).to(sq_col.dtype), alpha=1.0 - beta2)
        self._update = self.local_block((sq_row / sq_row.mean()).rsqrt_(), sq_col.rsqrt()).mul_(self._grad)
        self._grad = None
        m_old, u = state["exp_avg"].double(), self._update.double()
        sums = torch.stack([u * u, u * m_old, m_old * m_old])  # (3, rows, cols) of this shard
        return torch.cat([(u * u).sum()[None], self.at_offsets(sums.sum(2), sums.sum(1)).flatten()])

    def finish(self, stats):
        h, state = self.group.param_group, self._optimizer.state[self.stepped]
        (beta1, _, beta3), (_, eps2) = h["betas"], h["eps"]
        rows, cols = self.geometry.table_shape
        clip = 1.0 / max((float(stats[0]) / (rows * cols)) ** 0.5 / h["clip_threshold"], 1.0)
        u2, um, m2 = stats[1:].view(3, rows + cols)
        residual = beta1**2 * (clip * clip * u2 - 2 * clip * um + m2)  # sums of (u - m)^2, per row then column
        update = self._update.mul_(clip)
        self._update = None
        exp_avg = state["exp_avg"]
        exp_avg.mul_(beta1).add_(update, alpha=1 - beta1)
        res_row, res_col = state["exp_avg_res_row"], state["exp_avg_res_col"]
        res_row.mul_(beta3).add_((residual[:rows] / cols + eps2).to(res_row.dtype), alpha=1.0 - beta3)
        res_col.mul_(beta3).add_((residual[rows:] / rows + eps2).to(res_col.dtype), alpha=1.0 - beta3)
        step = self.local_block((res_row / res_row.mean()).rsqrt_(), res_col.rsqrt()) * exp_avg
        if h["weight_decay"] != 0:
            self.stepped.add_(self.stepped, alpha=-h["weight_decay"] * h["lr"])
        self.stepped.add_(-(step * h["lr"]))


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
        grad = self._counted_gradient(ids, grads, state, "exp_avg")
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
