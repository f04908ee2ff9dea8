"""The decision of one sharded module, as one typed value: its table kernels, its round, its state.

The sharder builds it once, at sharding, and installs it on the sharded module
(:func:`overlap_optim.plans.install_plan`); everything that asks about the
module's tables (``describe()``, the live-settings check, the keyed optimizer)
reads it through :func:`plan_of`.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from overlap_optim import plans
from overlap_optim._private import no_sync_unless_first_static
from overlap_optim.round import EndOfBackwardRound
from sharders.kernels import Accumulation, TableKernel
from sharders.table_state import ShardedTables

__all__ = ["ShardedModulePlan", "plan_of"]


@dataclasses.dataclass(frozen=True)
class ShardedModulePlan:
    """Attributes:
        tables: table name -> its kernel (every table of the module, on every rank, in config order).
        round: the module's end-of-backward round (no slots: it runs no collective).
        state: the tables' optimizer state in torch.optim's form.
        accumulation: the module's ``no_step`` flag, which its kernels read.
    """

    tables: dict[str, TableKernel]
    round: EndOfBackwardRound
    state: ShardedTables

    accumulation: Accumulation
    data_parallel: tuple[nn.Module, ...] = ()  # the module's DDP-wrapped lookups

    def accumulate(self, active: bool) -> None:
        """See :meth:`overlap_optim.plans.ModulePlan.accumulate`: every kernel of the module
        keeps its micro-batches' gradients while active; data-parallel tables accumulate as
        the dense part does, under DDP's ``no_sync`` (TorchRec keeps their DDP lookups out of
        ``modules()``, so it is entered here); frozen and unannotated tables have nothing to
        hold back."""
        if active == self.accumulation.active:
            return
        if active:
            self.accumulation.hold_back([no_sync_unless_first_static(ddp) for ddp in self.data_parallel])
        else:
            self.accumulation.release()


def plan_of(module: nn.Module) -> ShardedModulePlan | None:
    """The plan of a module sharded by our sharders; None for any other module."""
    plan = plans.plan_of(module)
    return plan if isinstance(plan, ShardedModulePlan) else None
