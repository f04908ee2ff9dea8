"""What overlap_optim keeps on a parameter or a module: one record each, behind one accessor.

A parameter carries a :class:`ParamRecord` (``record_of(p)``): its annotation group,
its clipping set, what took its update over, its guard hook, init_state's placeholder
mark, and how its fresh state is made. A module carries a :class:`ModuleRecord`
(``module_record(m)``): its sharding plan, step tracker, meta-parameter records, and
the like. No other file reads or writes an ``_overlap_*`` attribute.

torch's annotation contract lives here too: ``torch.distributed.optim._apply_optimizer_in_backward``
sets ``_optimizer_classes``, ``_optimizer_kwargs`` and ``_in_backward_optimizers`` on a
parameter, and TorchRec's sharders and torch's DDP read them. :func:`annotate` writes all
three with the record's group, :func:`contract_of` and :func:`live_optimizers` read them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

# Types named in strings only: this module imports nothing of the package (everything imports it).
AnnotationGroup = GradientClipping = Any

__all__ = [
    "ParamRecord", "ModuleRecord", "record_of", "record", "group_of", "annotate", "contract_of", "set_contract",
    "live_optimizers", "set_live_optimizers", "module_record", "module_record_of",
]

_PARAM = "_overlap_record"
_MODULE = "_overlap_module_record"
# torch's attribute names, read by torch's DDP and TorchRec's sharders (a contract, probed in _private).
_CLASSES, _KWARGS, _OPTIMIZERS = "_optimizer_classes", "_optimizer_kwargs", "_in_backward_optimizers"


@dataclasses.dataclass(eq=False)
class ParamRecord:
    """Everything overlap_optim keeps on one parameter (or a sharded table's weight)."""

    group: AnnotationGroup | None = None  # its annotation (apply_optimizer_in_backward)
    clipping: GradientClipping | None = None  # its clipping set (apply_gradient_clipping)
    taken_by: str | None = None  # what runs its update since clipping.mark_taken (a DDP hook, a sharder)
    guard: Any = None  # the hook that refuses a DDP reduction without ours (annotation)
    placeholder: dict[str, int] | None = None  # init_state's placeholder: its tensors' versions then
    state_maker: Callable[[], None] | None = None  # makes fresh state where its step does not (update)
    piece_step: Any = None  # placements.PieceStep: its update on its DTensor pieces
    local_sgd: Any = None  # the local_sgd.QSR that averages it (attached by register_optimizer_hook)
    window: Any = None  # accumulation.Window of the model no_step last ran it in (or that reduces it)


@dataclasses.dataclass(eq=False)
class ModuleRecord:
    """Everything overlap_optim keeps on one module."""

    plan: Any = None  # plans.ModulePlan of a module our sharders sharded
    step_tracker: Any = None  # accumulation.StepTracker of a model
    warned_bare: list[str] | None = None  # get_optimizers warned once about these unoptimized parameters
    meta_params: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # meta_params' record
    # name -> the annotation of a parameter that a registration replaced by one it cannot carry to (annotation)
    lost: dict[str, str] = dataclasses.field(default_factory=dict)
    fsdp_checked: bool = False  # lost.watch_fully_shard checked this FSDP module's parameters
    held_backward: Any = None  # sharders.fused_backward's hold on a fused kernel module
    keyed_optimizers: Any = None  # keyed's optimizers checked before a forward
    dense_settings: Any = None  # keyed.DenseSettings: the fixed settings of the model's dense groups, checked so
    window: Any = None  # accumulation.Window: of a model (window_of), or of the model of a sharded module
    checks_load_dtypes: bool = False  # sharders.weight_dtypes' load_state_dict pre-hook is on this model's root
    # checks a sharder asks checkpoint.load to run on the model's state read from a checkpoint (keys
    # relative to this module) before anything is loaded; each raises, naming what it refuses
    load_checks: list[Any] = dataclasses.field(default_factory=list)


def record_of(param: torch.Tensor) -> ParamRecord | None:
    """``param``'s record, or None if overlap_optim never marked it."""
    return param.__dict__.get(_PARAM)


def record(param: torch.Tensor) -> ParamRecord:
    """``param``'s record, made empty if it has none."""
    found = param.__dict__.get(_PARAM)
    if found is None:
        found = param.__dict__[_PARAM] = ParamRecord()
    return found


def group_of(param: torch.Tensor) -> AnnotationGroup | None:
    """The annotation group of ``param``, or None if it is not annotated."""
    found = param.__dict__.get(_PARAM)
    return None if found is None else found.group


def annotate(param: torch.Tensor, group: AnnotationGroup, keep_optimizers: bool = False) -> None:
    """Make ``group`` ``param``'s annotation: the record, and torch's three attributes (its live
    optimizers emptied unless ``keep_optimizers``)."""
    set_contract(param, group.optimizer_class, group.optimizer_kwargs)
    if not keep_optimizers:
        set_live_optimizers(param, [])
    record(param).group = group


def set_contract(param: torch.Tensor, optimizer_class: Any, kwargs: dict[str, Any]) -> None:
    """torch's ``_optimizer_classes`` and ``_optimizer_kwargs`` of ``param``, as TorchRec reads them."""
    setattr(param, _CLASSES, [optimizer_class])
    setattr(param, _KWARGS, [dict(kwargs)])


def contract_of(param: torch.Tensor) -> tuple[Any, dict[str, Any]] | None:
    """``(optimizer class, kwargs)`` of torch's annotation of ``param`` (ours, torch's or TorchRec's
    ``apply_optimizer_in_backward``), or None."""
    classes = getattr(param, _CLASSES, None)
    if not classes:
        return None
    return classes[0], dict(getattr(param, _KWARGS)[0])


def live_optimizers(param: torch.Tensor) -> list[Any] | None:
    """torch's ``_in_backward_optimizers`` of ``param`` (None if it has none)."""
    return param.__dict__.get(_OPTIMIZERS)


def set_live_optimizers(param: torch.Tensor, optimizers: list[Any]) -> None:
    setattr(param, _OPTIMIZERS, optimizers)


def module_record_of(module: Any) -> ModuleRecord | None:
    """``module``'s record, or None if overlap_optim never marked it."""
    return module.__dict__.get(_MODULE)


def module_record(module: Any) -> ModuleRecord:
    """``module``'s record, made if missing. ``module``: an ``nn.Module``, or any object with a
    ``__dict__`` (a fused kernel)."""
    namespace = module.__dict__
    found = namespace.get(_MODULE)
    if found is None:
        found = namespace[_MODULE] = ModuleRecord()
    return found

