"""FSDP2 for the dense part: in-backward optimizers on fully sharded parameters.

torch's ``fully_shard`` replaces every parameter it manages by a new Parameter, a
DTensor holding this rank's dim-0 shard, and the annotation and hooks of the old
object stay behind with it. :func:`fully_shard` wraps torch's and carries each
annotation over to the sharded parameter. FSDP2 then calls that parameter's
post-accumulate-grad hooks right after its reduce-scatter: the annotated optimizer
steps there, on this rank's shard of the averaged gradient, and the gradient is
released. The annotated parameters of one FSDP group step together, once the
last of them has its gradient (:class:`GroupStep`): one multi-tensor update per
virtual group, as a DDP bucket's.

An optimizer steps a shard exactly as it would step those rows of the whole
parameter only if it is separable along dim 0 (``OptimizerSpec.row_separable``;
element-wise along a 1-D parameter, ``OptimizerSpec.vector_separable``). Layer-wise
optimizers (Adafactor, LAMB, LARS, CAME, Muon, GaLore) are not; on 2-D parameters, and
Adafactor, LAMB, LARS and CAME on 1-D ones (biases), they step across FSDP's shards
with the core's cross-shard form (:mod:`overlap_optim.placements`): one all-reduce of
whole-tensor statistics per step for all of them (Muon's and GaLore's is the whole
matrix: a gather). Those on other shapes (Muon on a vector, which torch's Muon refuses as
well), and optimizers with no cross-shard form, are refused, naming the parameter.

Calling torch's own ``fully_shard`` on annotated parameters would leave them
untrained with no error; :mod:`overlap_optim.lost` refuses that model.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from overlap_optim.accumulation import window_of_params
from overlap_optim.annotation import (
    carry_over, reattach_annotations, record_annotations, replace_step_hook,
)
from overlap_optim.clipping import clipping_of
from overlap_optim.cross_shard import cross_shard_class
from overlap_optim.record import group_of, record
from overlap_optim.gradient_path import releasing_grad, take
from overlap_optim.placements import PieceStep, needs_piece_step, pieces_of
from overlap_optim.round import EndOfBackwardRound, Phase
from overlap_optim.update import step_params

__all__ = ["fully_shard", "GroupStep"]


def fully_shard(module: nn.Module, *, mesh: Any = None, **kwargs: Any) -> nn.Module:
    """torch's ``fully_shard`` on every submodule of ``module`` that directly owns
    parameters (innermost first), then on ``module`` itself, keeping the annotations.

    Each annotated parameter then steps in backward on its own shard, right after its
    reduce-scatter, and its gradient is released; the result is that of one process of
    ``torch.optim`` on the global batch. Parameters in ``ignored_params`` (the tables
    of a model under ``DistributedModelParallel``) are left alone.

    Args:
        module: the dense part, annotated with
            :func:`~overlap_optim.apply_optimizer_in_backward` (all of it or some).
        mesh: the device mesh to shard over: 1-D, or 2-D for HSDP (replicate over its first
            dimension, shard over its second); torch's default: every rank.
        **kwargs: torch's ``fully_shard`` keyword arguments, passed on to each call.

    Returns:
        ``module``, now an ``FSDPModule``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: a setting in-backward fp32 updates cannot follow
            (``offload_policy=CPUOffloadPolicy(...)``, an ``mp_policy`` that casts
            parameters or gradients to another dtype), or an annotated parameter whose
            optimizer is not separable along the sharded dim and has no cross-shard form
            for its shape (Adafactor, CAME, LAMB and LARS step 1-D and 2-D parameters
            across shards, Muon and GaLore 2-D ones); each named.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}")
    if mesh is not None and mesh.ndim > 2:
        raise ValueError(
            f"mesh {mesh!r} has {mesh.ndim} dimensions: overlap_optim.fully_shard shards over a 1-D mesh, or "
            "replicates over the first dimension of a 2-D one and shards over the second (HSDP)"
        )
    ignored = set(kwargs.get("ignored_params") or ())
    carry_over(module)
    recorded = {name: entry for name, entry in record_annotations(module).items() if entry[0] not in ignored}
    _check_settings(kwargs, recorded)
    shards = (mesh.size(mesh.ndim - 1) if mesh is not None else dist.get_world_size()) if dist.is_initialized() else 1
    _check_parameters(recorded, custom_placement=kwargs.get("shard_placement_fn") is not None, shards=shards)
    for sub in _owners(module, ignored):
        torch_fully_shard(sub, mesh=mesh, **kwargs)
    torch_fully_shard(module, mesh=mesh, **kwargs)
    reattach_annotations(module, recorded)
    _install_cross_shard(module, set(recorded))
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            annotated = [p for p in _managed(sub) if group_of(p) is not None
                         and record(p).piece_step is None]
            if annotated:
                group_step = GroupStep(annotated)
                for param in annotated:
                    replace_step_hook(param, group_step)
    return module


def _install_cross_shard(module: nn.Module, names: set[str]) -> None:
    """Give each annotated parameter (of ``names``) whose optimizer needs whole-tensor statistics a
    :class:`~overlap_optim.placements.PieceStep` (and each that no virtual group steps on its shard);
    their rounds share one all-reduce per step."""
    for name, param in module.named_parameters():
        group = group_of(param)
        if name not in names or group is None or not needs_piece_step(group, param):
            continue
        step = PieceStep(param, name)
        record(param).piece_step = step
        replace_step_hook(param, step)


class GroupStep:
    """The post-accumulate-grad hook of the annotated parameters of one FSDP group: FSDP2 calls
    it for each of them, one after the other, right after the group's reduce-scatter, and each
    gradient takes the gradient path (:func:`~overlap_optim.gradient_path.take`). The unclipped
    ones step together, at the last one's call (:func:`overlap_optim.update.step_params`: one
    multi-tensor update per virtual group); if some gradient does not come (a parameter unused in
    forward has none), those that came step when backward ends, in the SETTLE phase of the
    group's round. A clipped one steps alone, once its set has clipped it. Inside ``no_step``,
    nothing."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.unclipped = sum(clipping_of(p) is None for p in params)  # those that step together
        self.ready: list[torch.Tensor] = []
        self.round = EndOfBackwardRound(phase=Phase.SETTLE, local=True, start=self._start)

    def __call__(self, param: torch.Tensor) -> None:
        clip = clipping_of(param)
        step = functools.partial(self._join if clip is None else _step_alone, param)
        take(lambda _grads: step(), [param.grad], clip=clip, window=window_of_params(param),
             release=releasing_grad(param))

    def _join(self, param: torch.Tensor) -> None:
        self.round.arm()
        self.ready.append(param)
        if len(self.ready) >= self.unclipped:
            self.flush()

    def _start(self) -> None:
        self.round.before(self.flush)

    def flush(self) -> None:
        ready, self.ready = self.ready, []
        if ready:
            step_params(ready)


def _step_alone(param: torch.Tensor) -> None:
    step_params([param])


def _managed(module: nn.Module) -> list[torch.Tensor]:
    """The parameters of FSDP module ``module``'s own group: its subtree's, less those of nested
    FSDP modules."""
    found, stack = [], [module]
    while stack:
        sub = stack.pop()
        found += list(sub.parameters(recurse=False))
        stack += [c for c in sub.children() if not isinstance(c, FSDPModule)]
    return found


def _owners(module: nn.Module, ignored: set[torch.Tensor]) -> list[nn.Module]:
    """Submodules below ``module`` that directly own a parameter FSDP would manage, innermost first."""
    owners = []
    for sub in reversed(list(module.modules())):
        if sub is module or isinstance(sub, FSDPModule):
            continue
        if any(p not in ignored for p in sub.parameters(recurse=False)):
            owners.append(sub)
    return owners


def _check_settings(kwargs: dict[str, Any], recorded: dict) -> None:
    offload = kwargs.get("offload_policy")
    if isinstance(offload, CPUOffloadPolicy):
        raise ValueError(
            f"offload_policy={offload!r}: with CPU offload FSDP2 steps the optimizer on host copies after "
            "backward; in-backward updates are not built for it. Leave offload_policy unset"
        )
    policy = kwargs.get("mp_policy")
    if isinstance(policy, MixedPrecisionPolicy):
        dtypes = {entry[0].dtype for entry in recorded.values()}
        for setting in ("param_dtype", "reduce_dtype"):
            value = getattr(policy, setting)
            if value is not None and dtypes - {value}:
                raise ValueError(
                    f"mp_policy {setting}={value}: annotated parameters are {sorted(map(str, dtypes))}, and their "
                    "in-backward update would step on gradients computed (or reduced) in another precision "
                    "than the reference's; leave mp_policy's param_dtype and reduce_dtype unset"
                )


def _check_parameters(recorded: dict, custom_placement: bool, shards: int) -> None:
    for name, (param, group, clip) in recorded.items():
        if group is None or (group.spec.row_separable and group.spec.column_separable):
            continue
        spec = group.spec
        pieces = pieces_of(param) if shards > 1 and isinstance(param, DTensor) else None
        implementation = cross_shard_class(spec.optimizer_class, param.dim())
        if pieces is not None and pieces.dims != {0} and implementation is not None and implementation.on_both_axes() is None:
            raise ValueError(
                f"parameter {name!r} (shape {tuple(param.shape)}) is placed {tuple(param.placements)} already (tensor "
                f"parallelism), and fully_shard would split its rows too, over {shards} ranks: {spec.name}'s "
                "cross-shard form splits one axis; LAMB, LARS, Muon, GaLore, Adafactor and CAME step a matrix split "
                "along both. Annotate it with one of those, or an element-wise optimizer, or keep it out of fully_shard"
            )
        if _elementwise_on_dim0(spec, param, custom_placement):
            continue
        if cross_shard_class(spec.optimizer_class, param.dim()) is None or custom_placement:
            raise ValueError(
                f"parameter {name!r} (shape {tuple(param.shape)}) is annotated with {spec.name}, which does not "
                f"step a shard as it steps those rows of the whole parameter; {_cross_shard_shapes(spec)}. "
                "Keep this module out of fully_shard (DDP), or annotate it with an element-wise optimizer"
            )


def _cross_shard_shapes(spec: Any) -> str:
    """Which parameters ``spec``'s optimizer steps across FSDP's shards, for a refusal."""
    dims = [f"{ndim}-D" for ndim in (1, 2) if cross_shard_class(spec.optimizer_class, ndim) is not None]
    if not dims:
        return "it has no cross-shard form (its update reads the whole tensor in a way not built across shards)"
    return f"under FSDP it steps across shards on a {' or '.join(dims)} parameter sharded on dim 0 only"


def _elementwise_on_dim0(spec: Any, param: torch.Tensor, custom_placement: bool) -> bool:
    """Whether ``spec`` steps a dim-0 shard of ``param`` as it steps those rows of the whole."""
    if param.dim() == 1:
        return spec.vector_separable
    return (spec.row_separable and spec.column_separable) or (
        spec.row_separable and param.dim() >= 2 and not custom_placement)
