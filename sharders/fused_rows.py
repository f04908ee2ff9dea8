"""A fused table's backward on CPU in our compiled pass; FBGEMM keeps the lookup.

FBGEMM's CPU TBE runs the forward (the lookup) well, and its backward slowly: the
sort of the ids, each touched row's summed gradient and the update are its slowest
part of a fused step. For the optimizers FBGEMM fuses on CPU (EXACT_SGD,
EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD, the ones :data:`sharders.fbgemm.RULES`
picks), the compiled operators of ``overlap_optim/csrc/fused_rows.cpp`` do the
same backward in one pass over the touched rows, from the lookup's output
gradient: one radix sort of the kernel's ids, then per touched row its gradient
summed (per-sample weights and mean pooling applied), stepped with torch.optim's
arithmetic (torchrec's ``RowWiseAdagrad`` for the row-wise kind), written back in
place, into FBGEMM's own weight and state buffers, with FBGEMM's live learning rate
and eps. The state stays FBGEMM's: checkpoints, ``describe()`` and the keyed
optimizer see no difference.

An FP16 table fuses only here: the pass steps its row read in float32 and rounds the
result once, to nearest even (torch.optim on a float32 copy, as ``docs/precision.md``
states), where FBGEMM's CPU backward rounds the update to FP16 before adding it (two
roundings a step). Its state stays FBGEMM's float32.

Clipped by norm, the pass runs in two halves (:meth:`CompiledBackward.partial_norm`,
then :meth:`CompiledBackward.step`): the first sorts the ids and adds each touched
row's ``|g|^p`` to this rank's partial norm; the second, once the round has the
coefficient, scales each row's gradient and steps it. There is no second pass over the
ids. Between the halves the kernel keeps each touched row's gradient: summed where
several ids touched the row, and where one id did, a reference to that id's output
gradient row and scale (the output gradient is held until the step anyway). Both live
in buffers each clipped kernel keeps from step to step (as large as its largest step
needs): made afresh at every step, their pages would be faulted in again each time.

Which backward a fused kernel runs is a function of its configuration, the same on
every rank (:func:`applies`): ours where the operators are built and the kernel is
on CPU; FBGEMM's on CUDA and where the extension is absent (same results within
float rounding, slower). A lookup with a variable batch size per feature (VBE)
keeps FBGEMM's backward. :mod:`sharders.fused_backward` decides when the backward
runs; this module is what runs.
"""

from __future__ import annotations

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn

from overlap_optim import compiled
from sharders.pooling import Lookup

__all__ = ["applies", "CompiledBackward"]

# FBGEMM's optimizer -> the operator's code for it
_OPTIMIZERS = {EmbOptimType.EXACT_SGD: 0, EmbOptimType.EXACT_ADAGRAD: 1, EmbOptimType.EXACT_ROWWISE_ADAGRAD: 2}
_POOLING = {PoolingMode.SUM: 0, PoolingMode.MEAN: 1, PoolingMode.NONE: 2}
# The weight dtypes the pass steps (in float32, FP16 rounded once); FBGEMM's CPU TBE has no BF16 kernels.
_DTYPES = (torch.float32, torch.float16)

_STEP = compiled.op("fused_rows_step_")
_COALESCE = compiled.op("fused_rows_coalesce")
_APPLY = compiled.op("fused_rows_apply_")


def applies(optimizer: EmbOptimType, device_type: str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a fused kernel running FBGEMM's ``optimizer`` on ``device_type``, its weights in
    ``dtype``, takes our compiled backward. Depends on the configuration only."""
    return _STEP is not None and device_type == "cpu" and optimizer in _OPTIMIZERS and dtype in _DTYPES


class CompiledBackward:
    """The backward of one fused FBGEMM TBE module ``emb`` (float32 or FP16 weights on CPU), in our pass."""

    def __init__(self, emb: nn.Module) -> None:
        assert applies(emb.optimizer, "cpu"), f"FBGEMM's {emb.optimizer} has no compiled backward here"
        self.emb = emb
        self._optimizer = _OPTIMIZERS[emb.optimizer]
        self._pooling = _POOLING[emb.pooling_mode]
        self._feature_table = [int(t) for t in emb.feature_table_map]
        self._feature_offset = [int(d) for d in emb.D_offsets.tolist()[:-1]]
        self._rows = [int(rows) for rows, *_ in emb.embedding_specs]
        self._dims = [int(dim) for _, dim, *_ in emb.embedding_specs]
        self._held: torch.Tensor | None = None  # the output gradient the first half read, for the second
        self._summed = torch.empty(0)  # the first half's summed rows (of rows several ids touched)
        self._touched = torch.empty(0, dtype=torch.long)  # the first half's touched rows, for the second

    def _tables(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """FBGEMM's weight and state of each table, as views (taken at every step: a load may
        have replaced its buffers)."""
        weights = self.emb.split_embedding_weights()
        states = [] if self._optimizer == 0 else [s[0] for s in self.emb.split_optimizer_states()]
        return weights, states

    def _settings(self) -> tuple[float, float]:
        """FBGEMM's live learning rate and eps (:class:`sharders.fbgemm.FusedTable` keeps them)."""
        return float(self.emb.learning_rate_tensor), float(self.emb.optimizer_args.eps)

    def _inputs(self, lookup: Lookup, grad: torch.Tensor) -> tuple:
        indices, offsets, weights = lookup
        weights = None if weights is None else weights.to(torch.float32).contiguous()
        grad = grad.to(torch.float32)
        if grad.dim() != 2 or (grad.shape[1] > 1 and grad.stride(1) != 1):  # rows apart are fine, not columns
            grad = grad.contiguous()
        return (grad, indices.to(torch.long).contiguous(),
                offsets.to(torch.long).contiguous(), weights, self._pooling, self._feature_table,
                self._feature_offset)

    def partial_norm(self, lookup: Lookup, grad: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The first half under clipping by norm: ``sum |g|^p`` (``max |g|`` for inf) over the
        summed gradients of the rows ``lookup`` touched (float64, one element); what :meth:`step`
        needs of them is kept in the kernel's buffers (see the module doc)."""
        assert self._held is None, "a partial norm made twice before its step"
        inputs = self._inputs(lookup, grad)
        partial = _COALESCE(*inputs, self._rows, self._dims, float(norm_type), self._summed, self._touched)
        self._held = inputs[0]
        return partial

    def discard(self) -> None:
        """Forget what :meth:`partial_norm` kept: its clipping set refused the step (a non-finite
        norm), and nothing steps."""
        self._held = None

    def step(self, lookup: Lookup, grad: torch.Tensor, coefficient: torch.Tensor | None) -> None:
        """Update the rows ``lookup`` touched, in place. With ``coefficient`` (clipping by norm),
        the gradients :meth:`partial_norm` made are scaled by it and stepped; without, the whole
        backward runs in one pass."""
        weights, states = self._tables()
        lr, eps = self._settings()
        if coefficient is None:
            assert self._held is None, "a partial norm made, but no clipping coefficient"
            _STEP(*self._inputs(lookup, grad), weights, states, self._optimizer, lr, eps)
            return
        assert self._held is not None, "clipped without its partial norm"
        held, self._held = self._held, None
        _APPLY(weights, states, held, self._touched, self._summed, self._optimizer, lr, eps, float(coefficient))
