"""pytorch-optimizer's ``GaLore`` across shards (:class:`GaLoreTable`), on a matrix split along
rows, columns or both; matrices only (on a vector, GaLore is Adam: element-wise).

GaLore projects the gradient onto a low-rank subspace, read from the SVD of the whole gradient
every ``update_proj_gap`` steps, runs Adam there, and projects the result back. No statistic
short of the whole gradient gives that SVD, so, as Muon's, the slot is the matrix.

Per step, one slot in the ``STATISTICS`` round, summed across ranks: the whole gradient,
``R * C`` floats, each shard's at its own offsets and zeros elsewhere (a gather). Every rank then
runs the package's own projector (its class, read from the optimizer's module: the core imports
no optional package) and the low-rank Adam alike, and keeps its block of the update. The
moments are low-rank, whole on every rank.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from overlap_optim.cross_shard_base import GatherForm, nbytes
from overlap_optim.round import EndOfBackwardRound

__all__ = ["GaLoreTable"]

# The settings GaLore reads from its param group to make a parameter's projector.
_PROJECTOR_SETTINGS = ("rank", "update_proj_gap", "scale", "projection_type")


class GaLoreTable(GatherForm):
    """pytorch-optimizer's ``GaLore``: the whole gradient gathered, projected by the package's own
    projector on every rank, Adam on the projection, projected back; each shard keeps its block.
    Without a ``rank`` in its param group, GaLore is Adam on the whole gradient, and so is this."""

    @classmethod
    def _math_bytes(cls, geometry, shard_shape, dtype):
        """The round's slot at its peak (the whole gradient in ``dtype``, and in float64 the
        buffer, a copy and the sum); after it, the whole gradient, the SVD's two factors and the
        update projected back, each at most the matrix's size in ``dtype``. Outside the round,
        the shard's gradient and the whole matrix it is written into."""
        whole = nbytes(geometry.table_shape, dtype)
        outside = nbytes(shard_shape, dtype) + whole
        return max(outside, EndOfBackwardRound.slot_bytes(cls.slot_size(geometry), dtype), 4 * whole)

    def _fresh_state(self, state: dict[str, Any]) -> None:
        h = self.group.param_group
        if "rank" in h:
            projector = getattr(sys.modules[self.group.optimizer_class.__module__], "GaLoreProjector")
            state["projector"] = projector(**{key: h[key] for key in _PROJECTOR_SETTINGS if key in h})
        shapes = self.group.spec.state_shapes(self.geometry.table_shape)
        for name in ("exp_avg", "exp_avg_sq"):
            state[name] = self.stepped.new_zeros(shapes[name])
        state["step"] = 0

    def partials(self, ids, grads, state, h):
        return self.gathered(self._counted_gradient(ids, grads, state, "exp_avg"))

    def complete(self, stats):
        h, state = self.group.param_group, self._optimizer.state[self.stepped]
        grad = stats.view(self.geometry.table_shape).to(self.stepped.dtype)
        projector = state.get("projector")
        if projector is not None:
            grad = projector.project(grad, state["step"])
        beta1, beta2 = h["betas"]
        step_size = h["lr"] * math.sqrt(1.0 - math.pow(beta2, state["step"])) / (1.0 - math.pow(beta1, state["step"]))
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, weight=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        update = exp_avg_sq.sqrt().add_(h["eps"])
        torch.div(exp_avg, update, out=update)
        if projector is not None:
            update = projector.project_back(update)
        self.stepped.add_(self.own_block(update), alpha=-step_size)
        if h["weight_decay"] != 0.0:  # decoupled, after the update, as GaLore's apply_weight_decay
            self.stepped.mul_(1.0 - h["weight_decay"] * h["lr"])
