"""Where each meta parameter sits, so that an annotation outlives ``Module.to_empty``.

``Module.to_empty`` (and TorchRec's ``init_parameters``) replace each Parameter with a new one and
drop what the old one carried: its annotation, its clipping set, its hooks.
:func:`overlap_optim.annotation.carry_over` later annotates whatever parameter sits at a
recorded name now as its meta predecessor was. The record lives on the module, so a dropped
model takes its record with it.

The record is written where a module registers a meta parameter: torch's global
parameter-registration hook (``register_module_parameter_registration_hook``), registered when
this module is imported, records ``module -> name -> parameter`` for each meta parameter, at
construction and when a parameter is tied into a module later. Annotating costs nothing here.

What the hook did not see (a model built before ``overlap_optim`` was imported, or a parameter
written into ``_parameters`` directly) is recorded by the walk of the root module that each entry
point runs (:func:`replaced`, through ``carry_over``); a plain ``to_empty`` between such an
annotation and the first entry point loses it, as it would without ``overlap_optim``.
"""

from __future__ import annotations

import torch
from torch import nn

from overlap_optim import _private
from overlap_optim.record import module_record, module_record_of, record_of

__all__ = ["replaced"]


def _registered(module: nn.Module, name: str, param: torch.Tensor) -> None:
    """torch's parameter-registration hook: record a meta parameter where ``module`` registers it."""
    if param.is_meta:
        module_record(module).meta_params[name] = param


_HOOK = nn.modules.module.register_module_parameter_registration_hook(_registered)


def _marked(param: torch.Tensor) -> bool:
    found = record_of(param)
    return found is not None and (found.group is not None or found.clipping is not None)


def replaced(module: nn.Module, *, forget: bool) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """``(fqn, the meta parameter recorded there, the parameter there now)`` for each annotated (or
    clipped) record in ``module`` whose parameter was replaced (the one there now may be None, where
    a sharder took the table); ``forget``: their records are dropped too.

    One walk of ``module``: it first records each annotated (or clipped) meta parameter sitting in
    it that torch's hook did not see, and drops the record of a replaced one that carried nothing."""
    out = []
    for path, sub in module.named_modules():
        params = _private.module_parameters(sub)
        found = module_record_of(sub)
        for name, param in params.items():  # what torch's registration hook did not see
            if param is not None and param.is_meta and _marked(param):
                found = found or module_record(sub)
                found.meta_params[name] = param
        for name, old in list(found.meta_params.items() if found is not None else ()):
            now = params.get(name)
            if now is old:
                continue
            marked = _marked(old)
            if marked:
                out.append((f"{path}.{name}" if path else name, old, now))
            if forget or not marked:
                del found.meta_params[name]
    return out
