"""How a DTensor parameter steps, read from its placements.

A parameter that FSDP2 or tensor parallelism made a ``DTensor`` holds one piece on each rank, a
block of the whole (:func:`pieces_of`). Its gradient arrives placed as the parameter is, and each
piece steps where it lies:

- ``Replicate`` on every mesh dimension of more than one rank: every rank holds the whole parameter
  and the whole gradient, and steps it as one process would.
- Split (``Shard``, and FSDP2's strided shards over tensor parallelism) along one tensor dim, by one
  mesh dimension or several, or along both dims of a matrix (dp x tp's row-parallel weights). An
  optimizer whose update is separable along every split dim (:func:`exact_on_pieces`) steps each piece
  alone. A layer-wise one (Adafactor, CAME, LAMB, LARS, Muon, GaLore) steps across the pieces with its
  cross-shard form (:mod:`overlap_optim.cross_shard_base`): the first half of the update on this
  rank's piece in backward, the whole-tensor statistics summed over the ranks whose pieces make the
  whole (one all-reduce per round phase), then the second half (:class:`PieceStep`). Muon's and
  GaLore's statistic is the whole matrix: a gather. A matrix split along both dims takes the forms
  whose statistics are whole-tensor sums or the matrix (LAMB, LARS, Muon, GaLore), and Adafactor's
  and CAME's in two rounds.

:func:`refusal` says, before anything is changed, why a placement cannot be stepped exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from overlap_optim import _private
from overlap_optim.accumulation import window_of_params
from overlap_optim.clipping import clipping_of
from overlap_optim.cross_shard import cross_shard_class
from overlap_optim.cross_shard_base import Geometry
from overlap_optim.gradient_path import releasing_grad, take
from overlap_optim.record import group_of
from overlap_optim.round import EndOfBackwardRound
from overlap_optim.spec import AnnotationGroup, OptimizerSpec
from overlap_optim.table_optimizer import DenseTableOptimizer
from overlap_optim.update import drop_placeholder_state, live_optimizer, set_state_maker
from overlap_optim.virtual_groups import LocalState, virtual_key

__all__ = ["Pieces", "pieces_of", "exact_on_pieces", "needs_statistics", "needs_piece_step", "refusal", "PieceStep"]


@dataclasses.dataclass(frozen=True)
class Pieces:
    """How a DTensor parameter is split: this rank's piece, the tensor dims split, and the process
    group of the ranks whose pieces make the whole (None: every rank)."""

    geometry: Geometry
    dims: frozenset[int]
    group: Any


def pieces_of(param: DTensor) -> Pieces | None:
    """How ``param`` is split across ranks; None where it is whole on every rank.

    Raises:
        NotImplementedError: a placement that is neither a shard nor ``Replicate`` on a mesh dimension
            of more than one rank, or a split on some mesh dimensions but not all of a mesh that is not
            the whole world (its ranks' group is not built here); the message says which.
    """
    mesh, placements = param.device_mesh, param.placements
    split = [m for m, p in enumerate(placements) if _private.splits(p) and mesh.size(m) > 1]
    other = [p for m, p in enumerate(placements) if mesh.size(m) > 1 and not (_private.splits(p) or isinstance(p, Replicate))]
    if other:
        raise NotImplementedError(f"placements {tuple(placements)}")
    if not split:
        return None
    if len(split) == 1:
        group = mesh.get_group(split[0])
    elif len(split) == mesh.ndim and mesh.size() == dist.get_world_size():
        group = None
    else:
        raise NotImplementedError(f"placements {tuple(placements)} split on {len(split)} of {mesh.ndim} mesh dimensions")
    dims = frozenset(placements[m].dim for m in split)
    _, offsets = _private.dtensor_piece(param)
    axis = next(iter(dims)) if len(dims) == 1 and param.dim() == 2 else 0
    return Pieces(Geometry(tuple(param.shape), offsets, axis), dims, group)


def exact_on_pieces(spec: OptimizerSpec, ndim: int, dims: frozenset[int]) -> bool:
    """Whether ``spec`` steps each piece of a tensor of ``ndim`` dims split along ``dims`` as it
    steps those elements of the whole: by rows (dim 0, any tensor of 2 dims or more) or a matrix by
    columns (1) where its update is separable that way; a vector, or another split, only under an
    element-wise update (probed on a vector for a vector: :attr:`OptimizerSpec.vector_separable`)."""
    def separable(dim: int) -> bool:
        if ndim == 1:
            return spec.vector_separable
        if ndim >= 2 and dim == 0:
            return spec.row_separable
        if ndim == 2 and dim == 1:
            return spec.column_separable
        return spec.row_separable and spec.column_separable

    return all(separable(dim) for dim in dims)


def refusal(spec: OptimizerSpec, param: torch.Tensor) -> str | None:
    """Why ``param`` (a DTensor, or not) cannot be stepped exactly by ``spec`` where it is placed;
    None where it can."""
    if not isinstance(param, DTensor) or (spec.row_separable and spec.column_separable):
        return None  # element-wise: each piece steps alone, however it is placed
    try:
        pieces = pieces_of(param)
    except NotImplementedError as err:
        return f"it is placed as {err}, which {spec.name}'s cross-shard form does not step"
    if not needs_statistics(spec, param):
        return None
    implementation = cross_shard_class(spec.optimizer_class, param.dim())
    if implementation is None:
        shapes = [f"{n}-D" for n in (1, 2) if cross_shard_class(spec.optimizer_class, n) is not None]
        if not shapes:
            return f"{spec.name} does not step a piece as it steps those elements of the whole, and has no cross-shard form"
        return f"{spec.name} steps across pieces a {' or '.join(shapes)} parameter only"
    if pieces is None:
        return None
    if len(pieces.dims) > 1 and implementation.on_both_axes() is None:
        return (f"it is split along both its rows and its columns, and {spec.name}'s cross-shard form splits one "
                "axis")
    return implementation.unsupported(spec, pieces.geometry.axis)


def needs_statistics(spec: OptimizerSpec, param: DTensor) -> bool:
    """Whether ``param``'s update needs its optimizer's cross-shard form: split along a dim its
    optimizer is not separable by, or whole on every rank (``Replicate``) under an optimizer separable
    neither by rows nor by columns (a vector: not element-wise on a vector), whose update DTensor's own operators need not all run (LARS's
    ``_foreach_copy_``)."""
    if spec.row_separable and spec.column_separable:
        return False  # element-wise: each piece steps alone, however it is placed
    pieces = pieces_of(param)
    if pieces is None:
        return not (spec.vector_separable if param.dim() == 1 else spec.row_separable or spec.column_separable)
    return not exact_on_pieces(spec, param.dim(), pieces.dims)


def needs_piece_step(group: AnnotationGroup, param: torch.Tensor) -> bool:
    """Whether DTensor ``param`` steps with :class:`PieceStep`: where it needs statistics
    (:func:`needs_statistics`), and where no virtual group steps its pieces
    (:func:`~overlap_optim.virtual_groups.virtual_key` is None): ``torch.optim``'s own step on a DTensor
    runs DTensor's operators, which need not all have a rule (Rprop's masked assignment has none)."""
    if not isinstance(param, DTensor):
        return False
    return needs_statistics(group.spec, param) or virtual_key(group.spec, group.param_group, param) is None


class PieceStep:
    """The post-accumulate-grad hook of a DTensor parameter that steps on its pieces
    (:func:`needs_piece_step`), once its gradient is ready (after FSDP2's reduce-scatter, or tensor
    parallelism's backward).

    Where it needs statistics, its optimizer's cross-shard form (:mod:`overlap_optim.cross_shard_base`):
    the first half of the update on this rank's piece (none, on an empty one) and its partial sums
    into a round over the ranks whose pieces make the whole (:func:`pieces_of`; a replicated
    parameter's round is this rank's own); the round's one all-reduce at the end of backward, then the
    second half. Elsewhere, the optimizer's own class on this rank's piece, as ``torch.optim`` on a
    plain tensor (:class:`~overlap_optim.table_optimizer.DenseTableOptimizer`), at once.

    The state is the parameter's live optimizer's, its piece-shaped entries DTensors placed as the
    parameter is."""

    def __init__(self, param: DTensor, name: str) -> None:
        group = group_of(param)
        pieces = pieces_of(param)
        local = param.to_local().detach()  # the piece's own storage
        self.param, self.round = param, None
        if needs_statistics(group.spec, param):
            if pieces is None:  # whole on every rank: the form on one piece, its sums this rank's own
                geometry = Geometry(tuple(param.shape), (0,) * param.dim(), 0)
                self.round = EndOfBackwardRound(local=True)
            else:
                geometry = pieces.geometry
                self.round = EndOfBackwardRound(pieces.group)
            implementation = cross_shard_class(group.optimizer_class, param.dim())
            if pieces is not None and len(pieces.dims) > 1:
                implementation = implementation.on_both_axes()
            self.round.register(name, implementation.slot_size(geometry))
            self.shard: DenseTableOptimizer = implementation(local, group, name, geometry, self.round)
            sharded: set[str] | None = implementation.sharded_keys(group.spec, geometry)
        else:
            self.shard = DenseTableOptimizer(local, group, name)
            sharded = None  # element-wise: every entry shaped as the piece is placed as the parameter
        # The live optimizer's own dict, looked up at each access (a checkpoint load replaces it), under the
        # tensor the shard steps (the shard itself, or a low-precision shard's float32 copy).
        self.shard._optimizer.state[self.shard.stepped] = LocalState(
            lambda: live_optimizer(param).state[param], param, sharded)
        set_state_maker(param, self.shard._make_placeholder)  # zeros, kept in the group's state_dtype

    def __call__(self, param: torch.Tensor) -> None:
        take(functools.partial(self._first_half, param), [param.grad], clip=clipping_of(param),
             window=window_of_params(param), release=releasing_grad(param))

    def _first_half(self, param: torch.Tensor, grads: list[torch.Tensor]) -> None:
        grad = grads[0].to_local()
        drop_placeholder_state(param)  # an init_state placeholder that nothing was loaded over
        self.shard.step(torch.arange(grad.shape[0], device=grad.device), grad)
        if self.round is not None:
            self.round.arm()
        param.grad = None
