"""FBGEMM's fused backward, held back: when a fused table's update runs, and on what gradient.

What runs is FBGEMM's own backward, or on CPU our compiled one (:mod:`sharders.fused_rows`,
which reads the window's ids and output gradients directly, and makes its part of the norm in
the same pass); the rules of when are the same for both.

FBGEMM's TBE forms each touched row's gradient and applies its update inside one
backward kernel, from the lookup's output gradient; nothing comes out between
the two. Each fused kernel's lookup output therefore leaves the autograd graph
(:class:`HeldBackward`), and its backward receives the output gradient and
decides when FBGEMM's backward runs:

- **now**, as TorchRec runs it, for a table in no clipping set and outside
  ``no_step``;
- **at the end of backward**, on the output gradient times the clipping
  coefficient, for a table clipped by norm (:mod:`sharders.fused_clipping`
  rebuilds its part of the norm);
- **after the window's last micro-batch**, inside ``overlap_optim.no_step``: each
  micro-batch's ids and output gradient are kept, and the first backward outside
  the block runs one lookup over their concatenation (the last micro-batch
  included) and FBGEMM's backward on it. FBGEMM's exact kernels add up duplicate
  rows, so that is one update on the summed gradient; a row counts as touched if
  any micro-batch touched it. What a window holds: each micro-batch's ids,
  offsets, per-sample weights and output gradient (``[batch, dims]`` pooled, ``[ids, dim]``
  unpooled): it grows
  linearly with k.

It also counts the updates (``on_update``): torch.optim's ``step`` of the
kernel's tables. Variable batch sizes per feature (VBE) keep FBGEMM's own
backward, and are refused with clipping or accumulation, naming the tables.
"""

from __future__ import annotations

import functools
import operator
import inspect
from collections.abc import Callable
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from torch import nn

from overlap_optim.accumulation import module_accumulating, window_of_module
from overlap_optim.clipping import GradientClipping
from overlap_optim.gradient_path import Keep, take
from overlap_optim.record import module_record, module_record_of
from sharders.fused_clipping import row_partial_norm
from sharders.fused_rows import CompiledBackward
from sharders.pooling import Lookup, concatenate_lookups

__all__ = ["HeldBackward", "held_backward_of"]

def held_backward_of(emb: nn.Module) -> HeldBackward | None:
    """The :class:`HeldBackward` installed on a fused TBE module, or None."""
    found = module_record_of(emb)
    return None if found is None else found.held_backward


class HeldBackward:
    """Installed on one fused TBE module (``emb``, running ``tables``); see the module doc.

    Args:
        clip: the clipping set of the kernel's tables (by norm), or None.
        owner: the sharded module, whose model's ``no_step`` window holds the updates back.
        on_update: called after each update ran.
        compiled: the kernel's backward in our compiled pass (:mod:`sharders.fused_rows`), or None:
            FBGEMM's own backward runs.
    """

    def __init__(
        self,
        emb: nn.Module,
        tables: list[str],
        clip: GradientClipping | None,
        owner: nn.Module,
        on_update: Callable[[], None],
        compiled: CompiledBackward | None = None,
    ) -> None:
        assert clip is None or clip.by_norm, "clipping by value runs in the fallback"
        self.emb, self.tables, self.clip, self.owner = emb, tables, clip, owner
        self.on_update, self.compiled = on_update, compiled
        # how the model's window keeps the kernel's gradient: its micro-batches, (lookup, output
        # gradient, whether the lookup is several micro-batches' concatenation), listed
        self.keep = Keep(self, add=operator.add)
        self._signature = inspect.signature(emb.forward)
        self._anchor = torch.zeros(0, requires_grad=True)  # makes the output require grad, gets none
        emb.register_forward_hook(self._detach, with_kwargs=True)
        module_record(emb).held_backward = self

    def held_bytes(self) -> int:
        """Bytes the open window holds: each micro-batch's ids, offsets, weights and output gradient."""
        tensors = [t for (lookup, grad, _) in self._kept() for t in (*lookup, grad) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _detach(self, _emb: nn.Module, args: tuple, kwargs: dict[str, Any], output: torch.Tensor) -> Any:
        if not output.requires_grad:
            return None
        bound = self._signature.bind(*args, **kwargs).arguments
        if bound.get("batch_size_per_feature_per_rank") is not None:  # VBE: FBGEMM's own backward
            if self.clip is not None or module_accumulating(self.owner) or self._kept():
                raise NotImplementedError(
                    f"fused table(s) {self.tables} got a variable batch size per feature (VBE) with gradient "
                    "clipping or inside no_step; pin them to the fallback (fallback_tables=[...])"
                )
            # FBGEMM's backward rounds an FP16 update twice: the sharded module refused the batch before
            assert self.emb.weights_precision == SparseType.FP32, f"a VBE batch reached FP16 fused tables {self.tables}"
            output.register_hook(lambda _grad: self.on_update())
            return None
        lookup = (bound["indices"], bound["offsets"], bound.get("per_sample_weights"))
        return _Held.apply(output.detach(), self._anchor, [self, output, lookup])

    def _kept(self) -> list[tuple[Lookup, torch.Tensor, bool]]:
        """The micro-batches the model's open window keeps for this kernel (none outside one)."""
        window = window_of_module(self.owner)
        return [] if window is None else window.kept.get(self, {}).get(0, [])

    def backward(self, output: torch.Tensor, lookup: Lookup, grad: torch.Tensor) -> None:
        """From backward, with the lookup's output gradient: by the gradient path
        (:func:`~overlap_optim.gradient_path.take`), update now, hold it for the norm, or keep it
        for the window's last micro-batch."""
        take(functools.partial(self._step, output), [(0, [(lookup, grad, False)])], clip=self.clip,
             window=window_of_module(self.owner), keep=self.keep, norm=self._norm if self.clip is not None else None,
             release=self.compiled.discard if self.compiled is not None else None)

    def _batch(self, grads: list[tuple[int, list[tuple[Lookup, torch.Tensor, bool]]]]) -> tuple[Lookup, torch.Tensor, bool]:
        """The one lookup to update on: the micro-batch, or one over the window's micro-batches
        (made once, kept in their place)."""
        ((_, batches),) = grads
        if len(batches) > 1:
            lookups = [(lookup, grad) for lookup, grad, _ in batches]
            batches[:] = [(*concatenate_lookups(lookups, len(self.emb.feature_table_map), self.emb.pooling_mode), True)]
        return batches[0]

    def _norm(self, grads: list) -> torch.Tensor:
        lookup, grad, _ = self._batch(grads)
        if self.compiled is not None:
            return self.compiled.partial_norm(lookup, grad, self.clip.norm_type)
        return row_partial_norm(self.emb, grad, *lookup, self.clip.norm_type)

    def _step(self, output: torch.Tensor, grads: list) -> None:
        lookup, grad, replay = self._batch(grads)
        if self.compiled is not None:  # our pass: no lookup to replay, the window's ids are its input
            self.compiled.step(lookup, grad, None if self.clip is None else self.clip.coefficient)
        else:
            if self.clip is not None:
                grad = grad * self.clip.coefficient.to(grad.device, grad.dtype)
            if replay:  # a window: one lookup over its micro-batches, at the weights they saw
                indices, offsets, weights = lookup
                with torch.enable_grad():
                    output = self.emb.forward(indices=indices, offsets=offsets, per_sample_weights=weights)
            torch.autograd.backward(output, grad)
        self.on_update()


class _Held(torch.autograd.Function):
    """Identity on the lookup's output; its backward hands the output gradient to ``HeldBackward``."""

    @staticmethod
    def forward(ctx: Any, detached: torch.Tensor, _anchor: torch.Tensor, held: list) -> torch.Tensor:
        ctx.held = held
        return detached.view_as(detached)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        if ctx.held is None:
            raise RuntimeError(
                "a second backward through the lookup of a fused table: its update ran already "
                "(retain_graph=True is not supported there)"
            )
        held_backward, output, lookup = ctx.held
        ctx.held = None
        held_backward.backward(output, lookup, grad)
        return None, None, None

