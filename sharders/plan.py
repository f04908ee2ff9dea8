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


def plan_of(module: nn.Module) -> ShardedModulePlan | None:
    """The plan of a module sharded by our sharders; None for any other module."""
    plan = plans.plan_of(module)
    return plan if isinstance(plan, ShardedModulePlan) else None
