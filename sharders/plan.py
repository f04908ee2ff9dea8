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
from overlap_optim.round import EndOfBackwardRound
from sharders.kernels import KernelKind, TableKernel
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

    def accumulate(self, active: bool) -> None:
        """See :meth:`overlap_optim.plans.ModulePlan.accumulate`. Data-parallel tables
        accumulate with the dense part (DDP's ``no_sync``); frozen and unannotated ones have
        nothing to hold back."""
        updating = [t.table for t in self.tables.values() if t.kind in _IN_KERNEL]
        if active and updating:
            raise NotImplementedError(
                f"no_step: tables {updating} update in their own kernels (fused, fallback or cross-shard), at "
                "every backward; accumulating their micro-batches is not supported yet. Make the batch one "
                "micro-batch, or run those tables data-parallel"
            )


_IN_KERNEL = (KernelKind.FUSED, KernelKind.LAZY, KernelKind.DENSE, KernelKind.CROSS_SHARD)


def plan_of(module: nn.Module) -> ShardedModulePlan | None:
    """The plan of a module sharded by our sharders; None for any other module."""
    plan = plans.plan_of(module)
    return plan if isinstance(plan, ShardedModulePlan) else None
