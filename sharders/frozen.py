"""The frozen kind: a table whose weight has ``requires_grad=False`` is looked up, never updated.

``torch.optim`` never steps a parameter that does not require grad, so a frozen
table keeps its weights bitwise, whatever it was annotated with (frozen wins
over the annotation). It holds no optimizer state and does no gradient work:

- model-parallel (table_wise, row_wise, column_wise...): it runs in a kernel of
  its own whose backward drops the output gradient. The kernel's output still
  requires grad, so the output all-to-all's backward runs on every rank, as its
  peers expect;
- data_parallel: its kernel's weights leave DDP, so nothing is all-reduced, and the kernel runs
  as on the other types.

An FP16 or BF16 table is looked up in float32 (:mod:`sharders.pooling`), as the
fallback's are: FBGEMM's CPU TBE has no BF16 lookup.

Setting ``requires_grad`` back to True on the sharded weight is refused at the
next lookup, on every rank, naming the table: the decision was made at
sharding. Shard again to train it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sharders import _private
from sharders.data_parallel import without_tables
from sharders.fallback import RowUpdates
from sharders.kernels import BuildContext, KernelKind, TableKernel

__all__ = ["FrozenTable", "FrozenRows"]


class FrozenTable(TableKernel):
    """A table whose weight had ``requires_grad=False`` when it was sharded."""

    kind = KernelKind.FROZEN
    semantics = "frozen"
    family = "frozen"
    sharded_state = False
    # Looked up only: rows read in float32 (sharders.pooling), never written.
    precisions = frozenset({torch.float32, torch.float16, torch.bfloat16})

    def batch_key(self) -> Hashable:
        return (self.kind,)

    @classmethod
    def adopt(cls, kernel: nn.Module, tables: list[TableKernel], context: BuildContext) -> None:
        FrozenRows.adopt(kernel)

    @classmethod
    def install(cls, tables: list[TableKernel], context: BuildContext) -> None:
        lookups = _private.lookups(context.sharded)
        names = {table.table for table in tables}
        for i, lookup in enumerate(lookups):
            if isinstance(lookup, DistributedDataParallel):
                _private.replace_lookup(context.sharded, i, without_tables(lookup, names))
                for kernel in _private.kernels_of_lookup(lookup.module):  # as on the other sharding types
                    if kernel.config.embedding_tables[0].name in names:
                        FrozenRows.adopt(kernel)
        for table in tables:  # the weights no longer require grad: so their views say
            bag = context.table_module(table.table)
            weight = getattr(bag, "weight", None)
            if isinstance(weight, nn.Parameter):
                bag.weight = weight = _private.slice_again(weight)
            if isinstance(weight, torch.Tensor) and weight.is_leaf:  # an empty one, where another rank holds it
                weight.requires_grad_(False)
            table.watch(context)

    def __init__(self, decision: Any) -> None:
        super().__init__(decision)
        self._weight: torch.Tensor | None = None

    def watch(self, context: BuildContext) -> None:
        """Remember the sharded weight whose ``requires_grad`` :meth:`check_live` reads."""
        self._weight = getattr(context.table_module(self.table), "weight", None)

    def check_live(self) -> None:
        if self._weight is not None and self._weight.requires_grad:
            raise ValueError(
                f"table {self.table!r} was frozen when it was sharded (requires_grad=False), and its "
                "weight now requires grad: a frozen table is looked up only, with no optimizer and no "
                "gradient. Set requires_grad before sharding, and shard the model again to train it"
            )

    def state_bytes(self, shard_shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> int:
        return 0

    def runs_as(self) -> str:
        return "frozen: looked up, never updated"


class FrozenRows(RowUpdates):
    """What a kernel of frozen tables runs (pooled or not): the lookup, and a backward that
    drops the gradient. Its output still requires grad (the anchor), so this rank's
    all-to-all backward runs."""

    @torch.no_grad()
    def update_rows(self, *unused: Any) -> None:
        """Nothing: a frozen table is never updated."""
