"""pytorch-optimizer's ``Lamb`` and ``LARS`` across shards, on a table or matrix and on a vector
(an FSDP2-sharded bias).

- :class:`LambTable`: ``Lamb``: Adam moments, then the trust ratio ``||w|| / ||u||``; the
  same on a vector. ``rectify``, ``adanorm`` and ``pre_norm`` have no cross-shard form and
  are refused, naming the table.
- :class:`LarsTable`: ``LARS``: the trust ratio ``c ||w|| / (||g|| + wd ||w||)``, then
  momentum; on a vector, as its package does, plain SGD with momentum.

Per step, one slot in the ``STATISTICS`` round, summed across ranks: ``||w||^2`` and
``||u||^2`` (Lamb) or ``||g||^2`` (LARS on a matrix), 2 floats; LARS on a vector, none.
"""

from __future__ import annotations

from typing import Any

import torch

from overlap_optim.cross_shard_base import CrossShardOptimizer, nbytes

__all__ = ["LambTable", "LarsTable"]


class LambTable(CrossShardOptimizer):
    """pytorch-optimizer's ``Lamb``: Adam moments, then the trust ratio ``||w|| / ||u||``; the same
    on a vector."""

    splits_both_axes = True  # whole-tensor sums


    @classmethod
    def _temporary_bytes(cls, geometry, shard_shape, dtype):
        # the gradient, the update, and the square of the weight, then of the update, for their norms
        return 3 * nbytes(shard_shape, dtype)

    @classmethod
    def _held_bytes(cls, geometry, shard_shape, dtype):
        return nbytes(shard_shape, dtype)  # the update

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
        grad = self._counted_gradient(ids, grads, state, "exp_avg")
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


class LarsTable(CrossShardOptimizer):
    """pytorch-optimizer's ``LARS``: the trust ratio ``c ||w|| / (||g|| + wd ||w||)``, then momentum.
    On a vector, as its package does, plain SGD with momentum (no trust ratio, no weight decay):
    element-wise, an empty slot."""

    splits_both_axes = True  # whole-tensor sums


    @classmethod
    def slot_size(cls, geometry):
        return 2 if len(geometry.table_shape) > 1 else 0

    @classmethod
    def _temporary_bytes(cls, geometry, shard_shape, dtype):
        # In the second half: the gradient, the scaled gradient, and the momentum's copy (one
        # fewer without momentum, or with Nesterov's: the count is the larger)
        return 3 * nbytes(shard_shape, dtype)

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
