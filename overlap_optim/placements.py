"""How a DTensor parameter steps, read from its placements.

A parameter that FSDP2 or tensor parallelism made a ``DTensor`` holds one local piece on each
rank. Its gradient arrives placed as the parameter is, and each piece steps where it lies:

- ``Replicate`` on every mesh dimension: every rank holds the whole parameter and the whole
  gradient, and steps it as one process would.
- ``Shard(d)`` on one mesh dimension: the parameter is split along its dim ``d`` across that
  dimension's ranks (``torch.chunk``'s split: the last pieces may be short or empty). An optimizer
  whose update is separable along ``d`` (:func:`exact_on_pieces`) steps each piece alone. A
  layer-wise one (Adafactor, CAME, LAMB, LARS, Muon) steps across the pieces with its cross-shard
  form (:mod:`overlap_optim.cross_shard_base`): the first half of the update on this rank's piece
  in backward, the whole-tensor statistics summed in the round of that dimension's process group
  (one all-reduce per round phase), then the second half (:class:`CrossShardStep`). Muon's
  statistic is the whole matrix: a gather.

:func:`refusal` says, before anything is changed, why a placement cannot be stepped exactly:
an optimizer with no cross-shard form on a split it is not separable by, or a parameter split
on two mesh dimensions at once for a layer-wise optimizer.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from overlap_optim.accumulation import window_of_params
from overlap_optim.clipping import clipping_of
from overlap_optim.cross_shard import cross_shard_class
from overlap_optim.cross_shard_base import CrossShardOptimizer, Geometry, sharded_state_layouts
from overlap_optim.gradient_path import releasing_grad, take
from overlap_optim.record import group_of
from overlap_optim.round import EndOfBackwardRound
from overlap_optim.spec import OptimizerSpec
from overlap_optim.update import drop_placeholder_state, live_optimizer, set_state_maker
from overlap_optim.virtual_groups import LocalState

__all__ = ["split_of", "exact_on_pieces", "needs_cross_shard_step", "refusal", "CrossShardStep"]


def split_of(param: DTensor) -> tuple[int, int] | None:
    """``(mesh dim, tensor dim)`` of the one ``Shard`` placement of ``param`` on a mesh dimension of
    more than one rank; None where every such placement is ``Replicate``.

    Raises:
        NotImplementedError: ``param`` is split on several mesh dimensions, or has a placement
            that is neither ``Shard`` nor ``Replicate``; the message says which.
    """
    mesh = param.device_mesh
    placed = [(m, p) for m, p in enumerate(param.placements) if mesh.size(m) > 1]  # one rank: whole there
    splits = [(m, p.dim) for m, p in placed if type(p) is Shard]
    other = [p for _, p in placed if not (isinstance(p, Replicate) or type(p) is Shard)]
    if other or len(splits) > 1:
        raise NotImplementedError(f"placements {tuple(param.placements)}")
    return splits[0] if splits else None


def exact_on_pieces(spec: OptimizerSpec, ndim: int, dim: int) -> bool:
    """Whether ``spec`` steps each piece of a tensor of ``ndim`` dims split along ``dim`` as it
    steps those elements of the whole: by rows (``dim`` 0, any tensor of 2 dims or more) or a
    matrix by columns (1) where its update is separable that way; a vector, or another split, only
    under an element-wise update."""
    if ndim >= 2 and dim == 0:
        return spec.row_separable
    if ndim == 2 and dim == 1:
        return spec.column_separable
    return spec.row_separable and spec.column_separable


def refusal(spec: OptimizerSpec, param: torch.Tensor) -> str | None:
    """Why ``param`` (a DTensor, or not) cannot be stepped exactly by ``spec`` where it is placed;
    None where it can."""
    if not isinstance(param, DTensor):
        return None
    try:
        split = split_of(param)
    except NotImplementedError as err:
        if spec.row_separable and spec.column_separable:
            return None  # element-wise: each piece steps alone, however it is placed
        return (f"it is placed as {err}: {spec.name}'s cross-shard form steps a parameter split on one mesh "
                "dimension (its other dimensions Replicate); 2-D splits are not built yet")
    if not needs_cross_shard_step(spec, param):
        return None
    implementation = cross_shard_class(spec.optimizer_class, param.dim())
    if implementation is None:
        shapes = [f"{n}-D" for n in (1, 2) if cross_shard_class(spec.optimizer_class, n) is not None]
        if not shapes:
            return f"{spec.name} does not step a piece as it steps those elements of the whole, and has no cross-shard form"
        return f"{spec.name} steps across pieces a {' or '.join(shapes)} parameter only"
    return None if split is None else implementation.unsupported(spec, split[1] if param.dim() == 2 else 0)


def needs_cross_shard_step(spec: OptimizerSpec, param: DTensor) -> bool:
    """Whether ``param`` steps with :class:`CrossShardStep`: split along a dim its optimizer is not
    separable by, or whole on every rank (``Replicate``) under an optimizer separable neither by rows
    nor by columns, whose update DTensor's own operators need not all run (LARS's ``_foreach_copy_``)."""
    if spec.row_separable and spec.column_separable:
        return False  # element-wise: each piece steps alone, however it is placed
    split = split_of(param)
    if split is None:
        return not (spec.row_separable or spec.column_separable)
    return not exact_on_pieces(spec, param.dim(), split[1])


class CrossShardStep:
    """The post-accumulate-grad hook of a DTensor parameter (a matrix or a vector) whose layer-wise
    optimizer steps across its pieces (:mod:`overlap_optim.cross_shard_base`): once its gradient is
    ready (after FSDP2's reduce-scatter, or tensor parallelism's backward), the first half of the
    update on this rank's piece (none, on an empty one) and its partial sums into the round of its
    mesh dimension's group; the round's one all-reduce at the end of backward, then the second half.
    The state is the parameter's live optimizer's, its piece-shaped entries DTensors placed as the
    parameter is."""

    def __init__(self, param: DTensor, name: str) -> None:
        group = group_of(param)
        split = split_of(param)
        mesh, local = param.device_mesh, param.to_local().detach()  # the piece's own storage
        if split is None:  # whole on every rank: the form on one piece, its sums this rank's own
            geometry = Geometry(tuple(param.shape), (0,) * param.dim(), 0)
            self.round = EndOfBackwardRound(local=True)
        else:
            mesh_dim, dim = split
            size = param.shape[dim]
            chunk = -(-size // mesh.size(mesh_dim))  # torch.chunk's split, as Shard places it
            offset = min(mesh.get_local_rank(mesh_dim) * chunk, size)
            assert local.shape[dim] == max(0, min(chunk, size - offset)), (name, local.shape, size, chunk)
            offsets = tuple(offset if d == dim else 0 for d in range(param.dim()))
            geometry = Geometry(tuple(param.shape), offsets, dim if param.dim() == 2 else 0)
            self.round = EndOfBackwardRound(mesh.get_group(mesh_dim))
        implementation = cross_shard_class(group.optimizer_class, param.dim())
        self.round.register(name, implementation.slot_size(geometry))
        self.param = param
        self.shard: CrossShardOptimizer = implementation(local, group, name, geometry, self.round)
        sharded = set(sharded_state_layouts(group.spec, geometry.axis, param.dim()))
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
        self.round.arm()
        param.grad = None
