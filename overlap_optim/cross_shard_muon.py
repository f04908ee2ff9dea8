"""``torch.optim.Muon`` across shards (:class:`MuonTable`), on a table or matrix split along
rows or columns; as torch's, matrices only.

Momentum (Nesterov's, if set) on each shard, then torch's own Newton-Schulz
orthogonalisation and learning-rate rule on the whole matrix.

Per step, one slot in the ``STATISTICS`` round, summed across ranks: the whole matrix,
``R * C`` floats, each shard's momentum-corrected update at its own offsets and zeros
elsewhere (a gather).
"""

from __future__ import annotations

import torch

from overlap_optim import _private
from overlap_optim.cross_shard_base import GatherForm, nbytes
from overlap_optim.round import EndOfBackwardRound

__all__ = ["MuonTable"]


class MuonTable(GatherForm):
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
    def _math_bytes(cls, geometry, shard_shape, dtype):
        """The round's slot at its peak: the whole matrix contributed in ``dtype``, and in float64 the
        buffer, a copy and the sum (28 bytes an element of the table, for float32). Outside the
        round, the shard's gradient, its Nesterov update and the matrix are less; so are, in the
        second half, the matrix in ``dtype`` and the orthogonalisation's bfloat16 copies beside
        the slot."""
        outside = 2 * nbytes(shard_shape, dtype) + nbytes(geometry.table_shape, dtype)
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
        return self.gathered(update)

    def complete(self, stats):
        h, shape = self.group.param_group, self.geometry.table_shape
        whole = stats.view(shape).to(self.stepped.dtype)
        ortho = _private.muon_orthogonalized(whole, h["ns_coefficients"], h["ns_steps"], h["eps"])
        self.stepped.mul_(1 - h["lr"] * h["weight_decay"])
        lr = _private.muon_adjusted_lr(h["lr"], h["adjust_lr_fn"], torch.Size(shape))
        self.stepped.add_(self.own_block(ortho), alpha=-lr)
