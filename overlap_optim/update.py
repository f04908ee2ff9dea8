"""Every way an annotated parameter is updated, in one place.

- :func:`step_when_ready`: the hook that runs once a parameter's gradient is
  fully accumulated: the gradient path (window, clip) to :func:`step_param`.
- :func:`step_param`: one parameter, its own ``torch.optim`` step with the
  group's current hyperparameters, then the gradient is released.
- :func:`step_params`: many parameters at once, as planned by a :class:`StepPlan`
  (which a list stepped again and again, a DDP bucket's, keeps).

Tables are updated by their shard's optimizer (:mod:`overlap_optim.table_optimizer`).

State made by ``init_state()`` and never loaded over is a placeholder, dropped
before the first real update (:func:`_real_state`; a table's rule is the same,
in :class:`~overlap_optim.table_optimizer.TableOptimizer`).

Many tensors at once (:func:`step_params`): tensors whose
settings differ only in floats form a virtual parameter group and share one
multi-tensor update (:mod:`overlap_optim.virtual_groups`); the rest step alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from overlap_optim import _private
from overlap_optim.accumulation import window_of_params
from overlap_optim.clipping import clipping_of
from overlap_optim.gradient_path import releasing_grad, take
from overlap_optim.record import group_of, live_optimizers, record, record_of, set_live_optimizers
from overlap_optim.spec import AnnotationGroup
from overlap_optim.state_precision import in_float32, stored
from overlap_optim.fused import applies as fused_applies
from overlap_optim.virtual_groups import VirtualKey, fused_kernel_step, multi_tensor_step, virtual_key

__all__ = [
    "step_when_ready", "step_param", "step_params", "StepPlan", "live_optimizer", "init_placeholder_state",
    "load_param_state", "has_real_state", "drop_placeholder_state", "placeholder_written", "param_restore_point",
    "set_state_maker", "versions",
]



def set_state_maker(param: torch.Tensor, make: Callable[[], None]) -> None:
    """For a parameter whose update is not its live optimizer's ``step`` (a layer-wise optimizer
    across FSDP shards): ``make()`` creates its fresh state in its live optimizer, where
    :func:`init_placeholder_state` would otherwise step that optimizer on a zero gradient."""
    record(param).state_maker = make


def step_when_ready(param: torch.Tensor) -> None:
    """The post-accumulate-grad hook of an annotated parameter outside DDP: its gradient takes
    the gradient path (:func:`~overlap_optim.gradient_path.take`) to :func:`step_param`."""
    take(lambda _grads: step_param(param), [param.grad], clip=clipping_of(param), window=window_of_params(param),
         release=releasing_grad(param))


def step_params(params: list[torch.Tensor]) -> None:
    """Step every param (each has ``.grad`` set) and release its grad: one multi-tensor
    update per virtual group; for a group that asks torch for ``fused``, torch's fused kernel
    called as its ``step()`` calls it, where it applies; one ``torch.optim`` step per annotation
    group for the other groups that ask for ``foreach`` or ``fused`` (as ``torch.optim`` steps a
    param group); the param's own ``torch.optim`` step for the rest (see :class:`StepPlan`)."""
    StepPlan(params).step([p.grad for p in params])
    for p in params:
        p.grad = None


class StepPlan:
    """How a list of annotated parameters steps together, worked out once: for a list that
    steps again and again (the annotated parameters of a DDP bucket).

    The plan is the grouping :func:`step_params` needs: by annotation group, then by
    virtual group (:func:`~overlap_optim.virtual_groups.virtual_key`, a function of the
    optimizer, its fixed settings, dtype and device). :meth:`step` checks that every
    parameter is still in the annotation group it was planned in, and plans again if not
    (a parameter annotated anew). What may change between two steps is read at each step:
    the float settings (from the param group), the fixed ones (refused if changed), and the
    live optimizer's state (a checkpoint load replaces it).
    """

    __slots__ = ("params", "_groups", "_checked", "_alone", "_sets")

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = list(params)
        self._plan()

    def _plan(self) -> None:
        self._groups = [group_of(p) for p in self.params]
        first: dict[int, torch.Tensor] = {}  # annotation group -> one of its parameters, for check_live
        alone: dict[tuple[int, str], list[int]] = {}  # (annotation group, how) -> its parameters in no virtual group
        sets: dict[VirtualKey, list[int]] = {}
        keys: dict[tuple, VirtualKey | str] = {}  # how a tensor steps depends on its group and these only
        for i, (param, group) in enumerate(zip(self.params, self._groups)):
            if id(group) not in first:
                first[id(group)] = param
                check_live(param)  # before virtual_key reads the fixed settings
            kind = (id(group), param.dtype, param.device, param.is_sparse, type(param))
            if kind not in keys:
                keys[kind] = _planned_as(group, param)
            key = keys[kind]
            if isinstance(key, str):
                alone.setdefault((id(group), key), []).append(i)
            else:
                sets.setdefault(key, []).append(i)
        self._checked = list(first.values())
        self._alone = [(how, index, self._groups[index[0]]) for (_, how), index in alone.items()]
        self._sets = [
            (self._groups[index[0]].spec, [self.params[i] for i in index], index,
             [self._groups[i].param_group for i in index])
            for index in sets.values()
        ]

    def step(self, grads: list[torch.Tensor]) -> None:
        """Step the planned parameters on ``grads`` (one per parameter, in order). A parameter
        stepped by ``torch.optim``'s own step gets its ``.grad`` set, and released after."""
        if not all(map(_in_group, self.params, self._groups)):
            self._plan()
        for param in self._checked:
            check_live(param)
        for how, index, group in self._alone:
            members = [self.params[i] for i in index]
            if how == "fused":
                with in_float32(_real_states(members), [group.state_dtype] * len(members)) as states:
                    fused = fused_kernel_step(group.spec, members, [grads[i] for i in index], states,
                                              [group.param_group] * len(index))
                if fused:
                    continue
            for i in index:
                self.params[i].grad = grads[i]
            if how == "own":
                for param in members:
                    step_param(param)
            else:
                _step_together(members)
        for spec, members, index, hypers in self._sets:
            with in_float32(_real_states(members), [self._groups[i].state_dtype for i in index]) as states:
                multi_tensor_step(spec, members, [grads[i] for i in index], states, hypers)


def _planned_as(group: AnnotationGroup, param: torch.Tensor) -> VirtualKey | str:
    """How ``param`` of ``group`` steps: with its virtual group (the key), or alone: "fused" (a
    group that asks for ``fused=True``, where torch's fused kernel is called here as its
    ``step()`` would call it; "together" if that declines at a step), "together" (one
    ``torch.optim`` step for the annotation group's share), or "own" (the param's own step)."""
    if _steps_together(group):
        fused = group.param_group.get("fused") and fused_applies(group.spec.optimizer_class, param)
        return "fused" if fused else "together"
    return virtual_key(group.spec, group.param_group, param) or "own"


def _in_group(param: torch.Tensor, group: AnnotationGroup) -> bool:
    return group_of(param) is group


def _steps_together(group: AnnotationGroup) -> bool:
    """The user asked torch for its multi-tensor (``foreach``) or fused kernel, and the
    optimizer keeps no state in its param group (which one call for many tensors would share)."""
    flags = group.param_group
    return bool(flags.get("foreach") or flags.get("fused")) and not group.spec.group_state


def _step_together(members: list[torch.Tensor]) -> None:
    """One ``optimizer.step()`` over ``members`` (all of one annotation group), as ``torch.optim``
    with ``foreach``/``fused`` steps a param group. Each tensor's state stays its own live
    optimizer's: the stepping optimizer reads and writes those very dicts, linked anew at every
    step (a checkpoint load replaces them)."""
    group = group_of(members[0])
    key = tuple(id(p) for p in members)
    optimizer = group.together.get(key)
    if optimizer is None:  # the tensors stay alive while it holds them: their ids stay theirs
        optimizer = group.together[key] = group.spec.make(members)
    kept = [_real_state(p, live_optimizer(p)) for p in members]
    with in_float32(kept, [group.state_dtype] * len(members)) as states:
        for p, state in zip(members, states):
            optimizer.state[p] = state
        group.step(optimizer)
    for p, state in zip(members, kept):
        optimizer.state[p] = state
        p.grad = None


def live_optimizer(param: torch.Tensor) -> torch.optim.Optimizer | None:
    """The param's live optimizer, created on first use; None while on meta."""
    optimizers = live_optimizers(param)
    if optimizers:
        return optimizers[0]
    group: AnnotationGroup | None = group_of(param)
    if group is None or param.is_meta:
        return None
    optimizer = group.spec.make([param])
    set_live_optimizers(param, [optimizer])
    return optimizer


def step_param(param: torch.Tensor) -> None:
    """Run the param's optimizer on its current grad with the group's current
    hyperparameters, then release the grad."""
    optimizer = live_optimizer(param)
    assert optimizer is not None, "step_param on a parameter without a live optimizer"
    check_live(param)
    _step_in_float32(param, optimizer, _real_state(param, optimizer))
    param.grad = None


def _step_in_float32(param: torch.Tensor, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """The group's step of ``param`` by its ``optimizer``, on ``state`` kept in the group's
    ``state_dtype`` (:mod:`overlap_optim.state_precision`; float32: as it is)."""
    group = group_of(param)
    with in_float32([state], [group.state_dtype]) as (work,):
        optimizer.state[param] = work
        group.step(optimizer, param)
    optimizer.state[param] = state


def check_live(param: torch.Tensor) -> None:
    """Refuse a fixed (non-float) setting of ``param``'s group changed since annotation."""
    group = group_of(param)
    group.spec.check_live(group.param_group, lambda: f"a parameter of shape {tuple(param.shape)} in {_named(group)}")


def _named(group: AnnotationGroup) -> str:
    """``group`` as an error names it: by its place in ``get_optimizers``' param groups once listed."""
    where = "its annotation group" if group.index is None else f"param group {group.index}"
    return f"{where} ({group.spec.name})"


def init_placeholder_state(param: torch.Tensor) -> None:
    """Give ``param`` state to load a checkpoint over, if it has none: a step on a zero
    gradient, with the weight put back. The state is a placeholder: the next update drops
    it unless :func:`load_param_state` replaced it."""
    optimizer = live_optimizer(param)
    if optimizer is None or optimizer.state.get(param):
        return
    make = record(param).state_maker
    if make is not None:
        make()
    else:
        kept = param.detach().clone()
        param.grad = torch.zeros_like(param)
        _step_in_float32(param, optimizer, optimizer.state[param])
        with torch.no_grad():
            param.copy_(kept)
        param.grad = None
    record(param).placeholder = versions(optimizer.state.get(param, {}))


def versions(state: dict[str, Any]) -> dict[str, int]:
    """The version counters of ``state``'s tensors: any in-place write (``dcp.load`` filling a
    state dict) bumps them."""
    return {name: _private.tensor_version(value) for name, value in state.items() if isinstance(value, torch.Tensor)}


def has_real_state(param: torch.Tensor) -> bool:
    """Whether ``param`` has optimizer state that is not an :func:`init_placeholder_state` placeholder."""
    optimizer = live_optimizer(param)
    return bool(optimizer is not None and optimizer.state.get(param)) and _placeholder(param) is None


def placeholder_written(param: torch.Tensor) -> bool:
    """Whether ``param``'s placeholder state was written in place since :func:`init_placeholder_state`
    made it (by ``dcp.load``, say) without :func:`load_param_state`: a load that would be lost."""
    made = _placeholder(param)
    optimizer = live_optimizer(param)
    return made is not None and optimizer is not None and versions(optimizer.state.get(param, {})) != made


def drop_placeholder_state(param: torch.Tensor) -> None:
    """Undo :func:`init_placeholder_state` if nothing was loaded over it."""
    optimizer = live_optimizer(param)
    if optimizer is not None:
        _real_state(param, optimizer)
        if not optimizer.state.get(param):
            optimizer.state.pop(param, None)


def param_restore_point(param: torch.Tensor) -> Callable[[], None]:
    """A function that puts ``param``'s optimizer state back as it is now (:func:`load_param_state`
    rebinds the state, never writes it: holding it is enough)."""
    optimizer = live_optimizer(param)
    state = None if optimizer is None else optimizer.state.get(param)
    mark = _placeholder(param)

    def restore() -> None:
        if optimizer is None:
            return
        optimizer.state.pop(param, None)
        if state is not None:
            optimizer.state[param] = state
        record(param).placeholder = mark
    return restore


def load_param_state(param: torch.Tensor, state: dict[str, Any]) -> None:
    """Replace ``param``'s optimizer state with ``state`` (empty: no state, as before a first step)."""
    optimizer = live_optimizer(param)
    optimizer.state.pop(param, None)
    if state:
        dtype = group_of(param).state_dtype  # a state of another dtype: cast once, to nearest even
        optimizer.state[param] = state if dtype is None else {k: stored(v, dtype) for k, v in state.items()}
    _take_placeholder(param)


def _real_state(param: torch.Tensor, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The param's state, after dropping a placeholder that nothing was loaded over."""
    if _take_placeholder(param):
        optimizer.state.pop(param, None)
    return optimizer.state[param]


def _real_states(params: list[torch.Tensor]) -> list[dict[str, Any]]:
    """:func:`_real_state` of each of ``params`` in its live optimizer, cheaper per tensor than calling it."""
    states = []
    for param in params:
        optimizers = live_optimizers(param)
        optimizer = optimizers[0] if optimizers else live_optimizer(param)
        if _take_placeholder(param):
            optimizer.state.pop(param, None)
        states.append(optimizer.state[param])
    return states


def _placeholder(param: torch.Tensor) -> dict[str, int] | None:
    """The placeholder mark of ``param`` (its state's versions when init_state made it), or None."""
    found = record_of(param)
    return None if found is None else found.placeholder


def _take_placeholder(param: torch.Tensor) -> bool:
    """Clear ``param``'s placeholder mark; whether it had one."""
    found = record_of(param)
    if found is None or found.placeholder is None:
        return False
    found.placeholder = None
    return True
