"""Annotate parameters with the optimizer that updates them during backward.

The annotation is metadata on each parameter, under the attribute names that
``torch.distributed.optim._apply_optimizer_in_backward`` and TorchRec's sharders
read (``_optimizer_classes``, ``_optimizer_kwargs``, ``_in_backward_optimizers``),
so stock TorchRec code sees the same annotation. On an ordinary, unsharded model
the update runs from a post-accumulate-grad hook and the gradient is released
right after it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from overlap_optim import _private, meta_params, placements
from overlap_optim.lost import note_lost, watch_fully_shard
from overlap_optim.clipping import GradientClipping, clipping_of, join_clipping, taken_by
from overlap_optim.record import annotate, contract_of, group_of, record, record_of, set_live_optimizers
from overlap_optim.spec import AnnotationGroup, OptimizerSpec, describe_optimizer, needs_closure
from overlap_optim.state_precision import check_state_dtype
from overlap_optim.update import live_optimizer, step_when_ready

__all__ = [
    "apply_optimizer_in_backward", "materialize", "record_annotations", "reattach_annotations", "AnnotationGroup",
    "needs_closure", "replace_step_hook", "carry_over",
]

# Constructor arguments that are not settings a user may pass as kwargs.
_CONSTRUCTOR_ONLY = ("params",)


def apply_optimizer_in_backward(
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[torch.Tensor],
    optimizer_kwargs: dict[str, Any] | None = None,
    *,
    replace: bool = False,
    group_options: dict[str, Any] | None = None,
    state_dtype: torch.dtype | None = None,
) -> AnnotationGroup:
    """Make ``optimizer_class(**optimizer_kwargs)`` update ``params`` during backward.

    Every check runs before anything is changed, so a refused call leaves the
    parameters as they were. Each parameter gets its own live optimizer (its
    state is per parameter, exactly as ``torch.optim`` keeps it), created when
    the parameter is real: meta-device parameters only record the metadata,
    for a sharder to read. Once a parameter's gradient is fully accumulated
    in backward, its optimizer steps and ``param.grad`` is set to None.

    ``Module.to_empty`` replaces Parameter objects and so drops annotations;
    use :func:`materialize` to move an annotated meta model to a device. The
    sharders, ``register_optimizer_hook`` and ``fully_shard`` carry the
    annotations over a plain ``to_empty`` too (:func:`carry_over`).

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass whose ``step``
            runs without a closure.
        params: the parameters to annotate; at least one, all requiring grad.
        optimizer_kwargs: constructor kwargs, such as ``{"lr": 0.05}``.
        replace: re-annotate parameters that already carry a different
            optimizer instead of refusing.
        group_options: settings the optimizer reads from its param group and
            not from its constructor, such as pytorch-optimizer's GaLore
            ``{"rank": 4, "update_proj_gap": 50, "scale": 0.25,
            "projection_type": "std"}``; float ones may change at run time
            like any float setting.
        state_dtype: keep the optimizer state in ``torch.bfloat16`` or
            ``torch.float16`` between steps (None: float32): each step runs in
            float32 and rounds each state tensor to it after
            (:mod:`overlap_optim.state_precision`).

    Returns:
        The :class:`AnnotationGroup` of this call, one param group of
        ``get_optimizers(model)``.

    Raises:
        TypeError: ``optimizer_class`` is not an Optimizer subclass, a kwarg is
            not a constructor argument, or a param is not a tensor.
        ValueError: the optimizer rejects a value, it cannot step without a
            closure, it cannot step a param of that many dims (torch's Muon on
            a bias; named), ``params`` is empty or holds a tensor that does not
            require grad, a param is annotated differently already or is run
            by a DDP hook or a sharder already, a group option is a
            constructor argument, or ``state_dtype`` is not BF16, FP16 or None.
        NotImplementedError: the optimizer's ``step()`` keeps a name both in
            its param group and per parameter (see :mod:`overlap_optim.spec`).

    Example:
        >>> apply_optimizer_in_backward(torch.optim.Adam, model.dense.parameters(), {"lr": 1e-3})
        >>> model(batch).sum().backward()  # dense layers are updated, grads are None
    """
    kwargs = dict(optimizer_kwargs or {})
    state_dtype = check_state_dtype(state_dtype)
    _check_class(optimizer_class)
    _check_kwarg_names(optimizer_class, kwargs)
    options = _check_group_options(optimizer_class, group_options)
    params = _check_params(params)
    spec = _describe(optimizer_class, kwargs, params, options)
    _check_not_taken(params)
    _check_not_annotated(params, optimizer_class, kwargs, replace)

    for i, param in enumerate(params):
        _refuse_placement(spec, param, f"params[{i}]")

    group = AnnotationGroup(spec, state_dtype)
    for param in params:
        _annotate(param, group)
    for i, param in enumerate(params):
        _install_placement_step(param, f"params[{i}] {tuple(param.shape)}")
    return group


def materialize(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """``module.to_empty(device=device)`` that keeps the annotations.

    ``to_empty`` builds new Parameter objects, so attributes and hooks on the
    meta parameters are lost. This re-applies each annotation group to the new
    parameters, in place, and returns ``module``. Values are uninitialised,
    as with ``to_empty``: call your init (e.g. ``reset_parameters``) after.
    """
    recorded = record_annotations(module)
    module.to_empty(device=device)
    reattach_annotations(module, recorded)
    return module


Recorded = dict[str, tuple[torch.Tensor, AnnotationGroup | None, GradientClipping | None]]


def record_annotations(module: torch.nn.Module, *, meta_only: bool = False) -> Recorded:
    """``{fqn: (parameter, its annotation group, its clipping set)}`` of the parameters of
    ``module`` that have either (with ``meta_only``, of those on the meta device), for
    :func:`reattach_annotations`."""
    recorded = {}
    for name, param in module.named_parameters():
        group, clip = group_of(param), clipping_of(param)
        if (group is not None or clip is not None) and (param.is_meta or not meta_only):
            recorded[name] = (param, group, clip)
    return recorded


def reattach_annotations(module: torch.nn.Module, recorded: Recorded) -> list[str]:
    """Annotate (and clip) each parameter now at a recorded FQN as the recorded one was, where
    something replaced the Parameter object (``Module.to_empty``, TorchRec's
    ``init_parameters``); the replaced object leaves its group and set. Returns the FQNs
    re-annotated."""
    done = []
    for name, (old, group, clip) in recorded.items():
        try:
            param = module.get_parameter(name)
        except AttributeError:  # the sharder took it (an embedding table)
            continue
        if _carry(old, param, group, clip):
            done.append(name)
    return done


def _carry(old: torch.Tensor, param: torch.Tensor, group: AnnotationGroup | None, clip: GradientClipping | None) -> bool:
    """Annotate ``param`` with ``group`` and put it in ``clip``'s set in place of ``old``, which
    leaves both; False, and nothing done, where ``param`` is ``old`` or carries either already."""
    if param is old or group_of(param) is not None or clipping_of(param) is not None:
        return False
    if group is not None:
        _remove_hooks(old)
        # Its live optimizer refers back to it: without this, a cycle keeps the replaced
        # (unsharded, under FSDP2) parameter alive until the next garbage collection.
        set_live_optimizers(old, [])
        _annotate(param, group)
    if clip is not None:
        clip.leave(old)
        join_clipping(param, clip)
    return True


def _registered(module: torch.nn.Module, name: str, param: torch.Tensor | None) -> None:
    """torch's parameter-registration hook: a parameter registered in place of an annotated (or
    clipped) one of the same shape and dtype (tensor parallelism's ``parallelize_module``, a plain
    ``setattr``) is annotated and clipped as its predecessor was, and steps where it is placed
    (:mod:`overlap_optim.placements`).

    Raises:
        ValueError: the predecessor's optimizer cannot step the new parameter exactly where it is
            placed; the message names the parameter, before anything is carried.
    """
    old = _private.module_parameters(module).get(name)
    if old is None or old is param:
        return
    group, clip = group_of(old), clipping_of(old)
    if group is None and clip is None:
        return
    label = f"{type(module).__name__}.{name}"
    if param is None or (old.shape, old.dtype) != (param.shape, param.dtype):
        note_lost(module, name, f"{tuple(old.shape)} {old.dtype} ({group.spec.name if group else 'clipped'})")
        return
    if group is not None:
        _refuse_placement(group.spec, param, label)
    if _carry(old, param, group, clip) and group is not None:
        _install_placement_step(param, label)


_CARRY_HOOK = torch.nn.modules.module.register_module_parameter_registration_hook(_registered)


def _refuse_placement(spec: OptimizerSpec, param: torch.Tensor, label: str) -> None:
    why = placements.refusal(spec, param)
    if why is not None:
        raise ValueError(
            f"{label} (shape {tuple(param.shape)}, placements {tuple(param.placements)}) is annotated with "
            f"{spec.name}, which cannot step it exactly where it is placed: {why}. Annotate it with an "
            "element-wise optimizer, or place it Replicate"
        )


def _install_placement_step(param: torch.Tensor, label: str) -> None:
    """Make ``param`` (annotated) step on its DTensor pieces where its placement needs it
    (:func:`~overlap_optim.placements.needs_piece_step`); its default step steps any other one. Its
    placement was checked first (:func:`_refuse_placement`)."""
    if not placements.needs_piece_step(group_of(param), param):
        return
    step = placements.PieceStep(param, label)
    record(param).piece_step = step
    replace_step_hook(param, step)


def carry_over(module: torch.nn.Module) -> list[str]:
    """Annotate (and clip) each parameter of ``module`` that replaced an annotated (or clipped)
    meta parameter since (``Module.to_empty``) as its predecessor was, from the record
    :mod:`overlap_optim.meta_params` keeps; returns the FQNs re-annotated. Call it before anything
    takes the parameters over (a sharder, a DDP hook, FSDP)."""
    done = []
    for fqn, old, now in meta_params.replaced(module, forget=True):
        if now is not None:
            done += reattach_annotations(module, {fqn: (old, group_of(old), clipping_of(old))})
    return done


def replace_step_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """Make ``hook`` (a post-accumulate-grad hook) what steps the annotated ``param`` in backward,
    instead of :func:`~overlap_optim.update.step_when_ready` stepping it alone; for a wrapper that
    steps parameters together (``overlap_optim.fsdp``)."""
    assert group_of(param) is not None, "replace_step_hook on a parameter without annotation"
    for handle in _private.pop_in_backward_hook_handles(param):
        handle.remove()
    _private.add_in_backward_hook_handle(param, param.register_post_accumulate_grad_hook(hook))


def _annotate(param: torch.Tensor, group: AnnotationGroup) -> None:
    old: AnnotationGroup | None = group_of(param)
    keep_state = (
        old is not None
        and old.optimizer_class is group.optimizer_class
        and _same_kwargs(old.optimizer_kwargs, group.optimizer_kwargs)
    )
    _remove_hooks(param)
    watch_fully_shard()
    annotate(param, group, keep_optimizers=keep_state)
    group.param_group["params"].append(param)
    # On FSDP2's id of it, which FSDP2 keeps on the module: it outlives a Parameter object that torch's
    # fully_shard replaced and the garbage collector took with its annotation group.
    _private.label_fsdp_uid(param, f"{tuple(param.shape)} ({group.spec.name})")
    live_optimizer(param)
    handle = param.register_post_accumulate_grad_hook(step_when_ready)
    # The same registry torch uses, so that DDP's lazy init finds and removes it.
    _private.add_in_backward_hook_handle(param, handle)
    # Not in that registry: it outlives DDP's removal, and says what went wrong.
    record(param).guard = param.register_post_accumulate_grad_hook(_refuse_foreign_reduction)


def _refuse_foreign_reduction(param: torch.Tensor) -> None:
    """At backward: the per-parameter update was removed by someone other than our DDP hook.

    That is DDP's lazy init, which replaces it with torch's own in-backward hook
    (it crashes on CPU, and with no hook at all the optimizer would step on the
    local, unreduced gradient). ``register_optimizer_hook`` removes this guard.
    """
    handles = _private.in_backward_hook_handles(param)
    if handles and all(_private.hook_handle_alive(h) for h in handles):
        return
    group = group_of(param)
    raise RuntimeError(
        f"a parameter of shape {tuple(param.shape)} annotated with {group.optimizer_class.__name__} is "
        "reduced by DistributedDataParallel without overlap_optim's hook: call "
        "overlap_optim.register_optimizer_hook(ddp_model) after wrapping it and before its first forward "
        "(under DistributedModelParallel, pass data_parallel_wrapper=sharders.DataParallelWrapper())"
    )


def remove_guard(param: torch.Tensor) -> None:
    """Drop the check of :func:`_refuse_foreign_reduction` (our DDP hook now updates ``param``)."""
    found = record_of(param)
    if found is not None and found.guard is not None:
        found.guard.remove()
        found.guard = None


def _remove_hooks(param: torch.Tensor) -> None:
    for handle in _private.pop_in_backward_hook_handles(param):
        handle.remove()
    remove_guard(param)
    old: AnnotationGroup | None = group_of(param)
    if old is not None:
        old.param_group["params"] = [p for p in old.param_group["params"] if p is not param]


def _check_class(optimizer_class: Any) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    if needs_closure(optimizer_class):
        raise ValueError(
            f"{optimizer_class.__name__} cannot run per parameter in backward: its step() "
            "needs a closure that re-evaluates the whole loss, and no closure exists "
            "while backward is running. Use an optimizer whose step() takes no closure."
        )


def _accepted_kwargs(optimizer_class: type[torch.optim.Optimizer]) -> list[str]:
    signature = inspect.signature(optimizer_class.__init__)
    return [
        name
        for name, p in signature.parameters.items()
        if name not in ("self", *_CONSTRUCTOR_ONLY)
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def _check_kwarg_names(optimizer_class: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> None:
    # A constructor's **kwargs (torchrec's RowWiseAdagrad has **unused) would
    # swallow a misspelt setting silently, so only named arguments count.
    accepted = _accepted_kwargs(optimizer_class)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(
            f"{optimizer_class.__name__} does not take the kwarg(s) {unknown}; "
            f"it accepts {accepted}"
        )


def _check_group_options(optimizer_class: type[torch.optim.Optimizer], options: Any) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise TypeError(f"group_options must be a dict of setting names to values, got {options!r}")
    constructor = sorted(set(options) & {"params", *_accepted_kwargs(optimizer_class)})
    if constructor:
        raise ValueError(
            f"group_options {constructor} are {optimizer_class.__name__} constructor arguments: pass them "
            "in optimizer_kwargs"
        )
    return dict(options)


def _check_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    if not params:
        raise ValueError("params is empty: pass at least one parameter to annotate")
    unique: dict[int, torch.Tensor] = {}
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{i}] is a {type(p).__name__}, not a tensor")
        if not p.requires_grad:
            raise ValueError(
                f"params[{i}] (shape {tuple(p.shape)}) does not require grad, so backward "
                "never reaches it: annotate trainable parameters only"
            )
        if not p.is_leaf:
            raise ValueError(
                f"params[{i}] (shape {tuple(p.shape)}) is not a leaf tensor but the result of an operation "
                f"({type(p.grad_fn).__name__}): no optimizer can step it; annotate the parameter itself"
            )
        unique[id(p)] = p
    return list(unique.values())


def _describe(optimizer_class: type, kwargs: dict[str, Any], params: list[torch.Tensor],
              options: dict[str, Any]) -> OptimizerSpec:
    """``describe_optimizer`` on the dims of ``params``. Where the optimizer refuses a param's number
    of dims and takes another in its dtype (torch's Muon steps matrices only), the refusal names the
    first such param; any other (a negative lr, a dtype it cannot step) stays as it was."""
    dims = {p.dim(): p.dtype for p in params}
    try:
        return describe_optimizer(optimizer_class, kwargs, dims, options)
    except ValueError as err:
        for i, param in enumerate(params):
            if dims.pop(param.dim(), None) is None:  # a kind already tried
                continue
            others = {2, *(p.dim() for p in params)} - {param.dim()}
            if not _takes(optimizer_class, kwargs, param.dim(), param.dtype, options) and any(
                    _takes(optimizer_class, kwargs, ndim, param.dtype, options) for ndim in others):
                raise ValueError(
                    f"params[{i}] (shape {tuple(param.shape)}) is {param.dim()}-D, and {optimizer_class.__name__} "
                    f"does not step {param.dim()}-D parameters (on a stand-in: {err}); annotate it with another "
                    "optimizer (an element-wise one, such as AdamW, for a bias)"
                ) from None
        raise


def _takes(optimizer_class: type, kwargs: dict[str, Any], ndim: int, dtype: torch.dtype, options: dict[str, Any]) -> bool:
    """Whether ``optimizer_class(**kwargs)`` steps an ``ndim``-D ``dtype`` parameter."""
    try:
        describe_optimizer(optimizer_class, kwargs, {ndim: dtype}, options)
    except ValueError:
        return False
    return True


def _check_not_taken(params: list[torch.Tensor]) -> None:
    """A parameter whose update a DDP hook or a sharder runs took its annotation then; annotated
    now, it would also step from its own hook, on its local gradient."""
    for i, p in enumerate(params):
        by = taken_by(p)
        if by is not None:
            raise ValueError(
                f"params[{i}] (shape {tuple(p.shape)}) is already run by {by}, which took its annotation when "
                "it was set up: annotate before DistributedModelParallel, the sharder or register_optimizer_hook"
            )


def _check_not_annotated(
    params: list[torch.Tensor],
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    replace: bool,
) -> None:
    if replace:
        return
    for i, p in enumerate(params):
        contract = contract_of(p)
        if contract is None:
            continue
        old_class, old_kwargs = contract
        if old_class is optimizer_class and _same_kwargs(old_kwargs, kwargs):
            continue
        raise ValueError(
            f"params[{i}] (shape {tuple(p.shape)}) is already annotated with "
            f"{old_class.__name__}({old_kwargs}); refusing to change it to "
            f"{optimizer_class.__name__}({kwargs}). Pass replace=True to re-annotate."
        )


def _same_kwargs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not torch.equal(torch.as_tensor(x), torch.as_tensor(y)):
                return False
        elif x != y:
            return False
    return True
