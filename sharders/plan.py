"""The decision of one sharded module, as one typed value: its table kernels, its round, its state.

The sharder builds it once, at sharding, and installs it on the sharded module
(:func:`overlap_optim.plans.install_plan`); everything that asks about the
module's tables (``describe()``, the live-settings check, the keyed optimizer)
reads it through :func:`plan_of`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import nn

from overlap_optim import plans
from overlap_optim._private import no_sync_unless_first_static
from overlap_optim.round import EndOfBackwardRound
from sharders.kernels import TableKernel
from sharders.table_state import ShardedTables

__all__ = ["ShardedModulePlan", "plan_of"]


@dataclasses.dataclass(frozen=True)
class ShardedModulePlan:
    """Attributes:
        tables: table name -> its kernel (every table of the module, on every rank, in config order).
        round: the module's end-of-backward round (no slots: it runs no collective).
        state: the tables' optimizer state in torch.optim's form.
    """

    tables: dict[str, TableKernel]
    round: EndOfBackwardRound
    state: ShardedTables
    data_parallel: tuple[nn.Module, ...] = ()  # the module's DDP-wrapped lookups
    # the checks its first lookup runs (sharders.live_settings), for what runs before it and changes the
    # model (a managed-collision collection's eviction): a refusal then leaves everything as it was
    before_lookup: Callable[[], None] | None = None

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """See :meth:`overlap_optim.plans.ModulePlan.accumulate`: data-parallel tables accumulate
        as the dense part does, under DDP's ``no_sync`` (TorchRec keeps their DDP lookups out of
        ``modules()``, so it is entered here); every other kernel reads the window itself; frozen
        and unannotated tables have nothing to hold back."""
        with contextlib.ExitStack() as stack:
            for ddp in self.data_parallel:
                stack.enter_context(no_sync_unless_first_static(ddp))
            yield

    def window_members(self) -> list[torch.Tensor]:
        """The flat weights the data-parallel lookups reduce (no parameters of the model)."""
        return [p for ddp in self.data_parallel for p in ddp.parameters()]


def plan_of(module: nn.Module) -> ShardedModulePlan | None:
    """The plan of a module sharded by our sharders; None for any other module."""
    plan = plans.plan_of(module)
    return plan if isinstance(plan, ShardedModulePlan) else None
