"""Annotations lost when something replaces an annotated parameter, refused by name.

An annotation lives on the Parameter object. Whatever puts a new object in its place
must carry the annotation over (:mod:`overlap_optim.annotation` does it for a plain
registration of the same shape and dtype, ``overlap_optim.materialize`` for
``Module.to_empty``, ``overlap_optim.fully_shard`` for FSDP2), or the new parameter
trains nothing, and nothing says so. The replacements that cannot be carried over
are refused here, naming the parameter, before any step:

- a registration of another shape or dtype (:func:`note_lost`): from the module's
  next forward;
- ``Module.to_empty`` (or TorchRec's ``init_parameters``) too late for
  :func:`~overlap_optim.annotation.carry_over`;
- torch's own ``fully_shard``, which writes its sharded parameters past torch's
  registration hooks: from the first forward of the FSDP module that holds them
  (:func:`watch_fully_shard`), so that a loop that never calls ``get_optimizers``
  is refused too.

``get_optimizers`` runs all three (:func:`refuse_lost`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from overlap_optim import _private, meta_params
from overlap_optim.clipping import clipping_of
from overlap_optim.record import group_of, module_record, module_record_of

__all__ = [
    "note_lost", "watch_fully_shard", "refuse_lost", "refuse_lost_registrations", "refuse_lost_meta_annotations",
    "refuse_lost_to_fsdp",
]


def note_lost(module: torch.nn.Module, name: str, what: str) -> None:
    """``module.name``, annotated as ``what``, was replaced by a parameter of another shape or dtype:
    refused from the module's next forward (and by ``get_optimizers``) until it is annotated."""
    found = module_record(module)
    if not found.lost:
        module.register_forward_pre_hook(_refuse_lost_registration)
    found.lost[name] = what


def _refuse_lost_registration(module: torch.nn.Module, *args: Any) -> None:
    refuse_lost_registrations(module)


def refuse_lost(model: torch.nn.Module, name: Callable[[str], str] = str) -> None:
    """Raise, naming it, for any parameter of ``model`` that replaced an annotated one and would
    train nothing (each way this module lists); ``name`` turns a meta record's FQN into the user's."""
    refuse_lost_to_fsdp(model)
    refuse_lost_registrations(model)
    refuse_lost_meta_annotations(model, name)


def refuse_lost_registrations(model: torch.nn.Module) -> None:
    """Raise, naming it, for a parameter of ``model`` registered in place of an annotated one whose
    annotation it could not take (another shape or dtype), and not annotated since: it would train
    nothing. A name annotated again, or gone, is forgotten."""
    for path, sub in model.named_modules():
        found = module_record_of(sub)
        if found is None or not found.lost:
            continue
        for name, what in list(found.lost.items()):
            now = _private.module_parameters(sub).get(name)
            if now is None or group_of(now) is not None or not now.requires_grad:
                del found.lost[name]
                continue
            fqn = f"{path}.{name}" if path else name
            raise ValueError(
                f"{fqn!r} was annotated ({what}) and replaced by a parameter of shape {tuple(now.shape)} {now.dtype}, "
                "which cannot take that annotation: it would train nothing. Annotate the new parameter with "
                "apply_optimizer_in_backward"
            )


def refuse_lost_meta_annotations(module: torch.nn.Module, name: Callable[[str], str] = str) -> None:
    """Raise, naming it, for a parameter of ``module`` that replaced an annotated (or clipped) meta
    parameter and carries neither: where ``carry_over`` came too late (a DDP that is not ours may
    hold it already)."""
    for fqn, old, now in meta_params.replaced(module, forget=False):
        if now is not None and group_of(now) is None and clipping_of(now) is None:
            group = group_of(old)
            carried = group.spec.name if group else "a gradient clipping set"
            raise ValueError(
                f"{name(fqn)!r} was annotated on the meta device ({carried}) "
                "and replaced since by a parameter without its annotation (Module.to_empty, or TorchRec's "
                "init_parameters under a data_parallel_wrapper that is not overlap_optim's): it would train "
                "nothing. Use overlap_optim.materialize(model, device) in place of to_empty, or "
                "sharders.DataParallelWrapper()"
            )


def refuse_lost_to_fsdp(model: torch.nn.Module) -> None:
    """Raise if torch's own ``fully_shard`` replaced annotated parameters of ``model`` and they were
    not annotated since: their optimizers would never run, and nothing would say so.

    Raises:
        RuntimeError: naming each such parameter (its FQN where it is still registered, else its shape)
            and its optimizer, and advising ``overlap_optim.fully_shard``.
    """
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    lost = [f"{names[id(sharded)]!r} {label}" if id(sharded) in names else label
            for m in model.modules() if isinstance(m, FSDPModule)
            for uid, sharded in _private.fsdp_taken(m)
            if (label := _private.fsdp_uid_label(uid)) is not None and group_of(sharded) is None]
    if lost:
        raise RuntimeError(
            f"{len(lost)} annotated parameter(s), {', '.join(lost[:6])}{' ...' if len(lost) > 6 else ''}, were "
            "sharded by torch's fully_shard, which replaced them with new parameters and left their in-backward "
            "optimizers behind: nothing would train them. Shard the annotated module with "
            "overlap_optim.fully_shard(module, mesh=mesh) instead"
        )


@functools.cache
def watch_fully_shard() -> torch.utils.hooks.RemovableHandle:
    """From now on, refuse (:func:`refuse_lost_to_fsdp`) at the first forward of each FSDP module the
    annotated parameters torch's own ``fully_shard`` took from it, before FSDP2 runs anything; once
    per FSDP module. Called at the first annotation; later calls do nothing.

    FSDP2 has no hook of its own to tell, so this is torch's global forward pre-hook: it costs every
    module call of the process (``benchmarks/lost.py`` measures it), one ``isinstance`` once the
    FSDP modules are checked. Under ``torch.compile`` the check runs eagerly, as FSDP2's own hooks do;
    ``torch.compile(module)`` then warns about global hooks (``module.compile()`` does not).
    """
    return torch.nn.modules.module.register_module_forward_pre_hook(_check_fsdp_module)


def _check_fsdp_module(module: torch.nn.Module, args: Any) -> None:
    if isinstance(module, FSDPModule):  # under torch.compile, a constant: no graph break for other modules
        _check_once(module)


@torch.compiler.disable  # eager even under torch.compile, as FSDP2's own hooks are
def _check_once(module: FSDPModule) -> None:
    if module_record(module).fsdp_checked:
        return
    refuse_lost_to_fsdp(module)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            module_record(sub).fsdp_checked = True
