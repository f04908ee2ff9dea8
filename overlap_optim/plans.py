"""How the core finds what a sharder decided for a sharded module: one value, installed once.

A sharder (``sharders``) decides, once, how each table of a module runs, and
installs that decision on the sharded module with :func:`install_plan`. The
core reads it back with :func:`plan_of` and needs only the part of it that
:class:`ModulePlan` names: the tables' optimizer state in torch.optim's form,
for :func:`overlap_optim.get_optimizers`. Arrows run from ``sharders`` to here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from overlap_optim.record import module_record, module_record_of
from overlap_optim.spec import AnnotationGroup

__all__ = ["ModulePlan", "TableStates", "install_plan", "plan_of"]

class TableStates(Protocol):
    """The optimizer state of a sharded module's tables, keyed relative to the module."""

    def keys(self) -> list[str]: ...
    def weight(self, key: str) -> Any: ...
    def groups(self) -> Iterator[tuple[str, AnnotationGroup]]: ...
    def state_dict(self) -> dict[str, dict[str, Any]]: ...
    def keys_with_state(self) -> list[str]: ...
    def check(self, key: str, saved: dict[str, Any]) -> None: ...
    def held_locally(self, key: str, saved: dict[str, Any]) -> bool: ...
    def load(self, key: str, saved: dict[str, Any]) -> None: ...
    def init_state(self) -> None: ...
    def drop_placeholder_state(self) -> None: ...
    def written_placeholders(self) -> list[str]: ...
    def restore_point(self, key: str) -> Callable[[], None]: ...


class ModulePlan(Protocol):
    """What a sharder decided for one sharded module."""

    @property
    def state(self) -> TableStates: ...

    def accumulate(self) -> contextlib.AbstractContextManager[None]:
        """What the module needs around ``overlap_optim.no_step`` (its kernels read the model's
        window from the module's record). Raises, naming the tables, for tables it cannot hold back."""

    def window_members(self) -> list[torch.Tensor]:
        """Tensors outside the model's parameters whose reduced gradients the window holds back."""


def install_plan(module: torch.nn.Module, plan: ModulePlan) -> None:
    """Install ``plan`` on the sharded ``module``; once."""
    if plan_of(module) is not None:
        raise RuntimeError(f"{type(module).__name__} already has a plan installed")
    module_record(module).plan = plan


def plan_of(module: torch.nn.Module) -> Any | None:
    """The plan a sharder installed on ``module``, or None for any other module."""
    found = module_record_of(module)
    return None if found is None else found.plan
