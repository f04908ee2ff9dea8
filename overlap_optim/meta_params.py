"""Where each annotated meta parameter sits, so that its annotation outlives ``Module.to_empty``.

``Module.to_empty`` (and TorchRec's ``init_parameters``) replace each Parameter with a new one and
drop what the old one carried: its annotation, its clipping set, its hooks. When a meta parameter is
annotated or clipped, :func:`remember` writes it into the record of each module that holds it, by
name; :func:`overlap_optim.annotation.carry_over` later annotates whatever parameter sits at that
name now as its meta predecessor was. The record lives on the module, so a dropped model takes its
record with it.

A parameter knows nothing of the module that holds it, so :func:`remember` asks the garbage
collector for the dicts that refer to the meta parameters (a module's ``_parameters``) and for the
module ``__dict__`` that holds each of those: two passes over the tracked objects per annotation
call with meta parameters (some 50 ms with torchrec imported), none for real ones.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import torch
from torch import nn

from overlap_optim import _private
from overlap_optim.record import module_record, module_record_of

__all__ = ["remember", "recorded", "forget"]

def remember(params: list[torch.Tensor]) -> None:
    """Record each meta parameter of ``params`` on every module that holds it, under its name."""
    meta = [p for p in params if p.is_meta]
    if not meta:
        return
    slots = [d for d in gc.get_referrers(*meta) if isinstance(d, dict)]
    for owner in gc.get_referrers(*slots):
        if not (isinstance(owner, dict) and any(owner.get(_private.MODULE_PARAMETERS) is s for s in slots)):
            continue
        record = module_record(owner).meta_params
        for name, value in owner[_private.MODULE_PARAMETERS].items():
            if any(value is p for p in meta):
                record[name] = value


def recorded(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """``(fqn, the meta parameter recorded there, the parameter there now)`` for each record in
    ``module`` whose parameter was replaced (the one there now is not meta: it may be None, where
    a sharder took the table)."""
    for path, sub in module.named_modules():
        found = module_record_of(sub)
        for name, old in list(found.meta_params.items() if found is not None else ()):
            now = _private.module_parameters(sub).get(name)
            if now is not old:
                yield f"{path}.{name}" if path else name, old, now


def forget(module: nn.Module, fqn: str) -> None:
    """Drop the record at ``fqn`` of ``module``."""
    path, _, name = fqn.rpartition(".")
    found = module_record_of(module.get_submodule(path))
    if found is not None:
        found.meta_params.pop(name, None)
