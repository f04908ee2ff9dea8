"""The cross-shard table kind: a split table whose layer-wise optimizer has a cross-shard form.

Its shards run in the fallback kernel (:mod:`sharders.fallback`) and meet in the
module's end-of-backward round: one all-reduce of whole-table statistics per
step, whatever the number of such tables. The per-shard math is the core's
(:mod:`overlap_optim.cross_shard_base`, one file per optimizer), shared with FSDP2's parameter shards.
"""

from __future__ import annotations

from typing import Any

import torch

from overlap_optim.cross_shard import cross_shard_class
from overlap_optim.cross_shard_base import CrossShardOptimizer, Geometry, sharded_state_layouts
from overlap_optim.round import EndOfBackwardRound
from sharders.fallback import FallbackTable
from sharders.kernels import BuildContext, KernelKind, split_axis

__all__ = ["CrossShardTable"]


class CrossShardTable(FallbackTable):
    """The kind of a split table whose layer-wise optimizer has a cross-shard form: its shards
    run in the fallback kernel and meet in the module's end-of-backward round."""

    kind = KernelKind.CROSS_SHARD
    semantics = "dense"
    # Each shard's step (both halves) on a float32 copy of the shard and float32 working copies of
    # state_dtype state, rounded once into the table and the state when the round has finished it.
    precisions = frozenset({torch.float32, torch.float16, torch.bfloat16})
    low_precision_state = True

    def _geometry(self, offsets: tuple[int, int] = (0, 0)) -> Geometry:
        return Geometry(self.decision.shape, tuple(offsets), split_axis(self.decision.sharding_type))

    def join_round(self, round_: EndOfBackwardRound) -> None:
        implementation = cross_shard_class(self.group.optimizer_class)
        round_.register(self.table, implementation.slot_size(self._geometry()))

    def make_optimizer(self, weight: torch.Tensor, config: Any, context: BuildContext) -> CrossShardOptimizer:
        implementation = cross_shard_class(self.group.optimizer_class)
        geometry = self._geometry(config.local_metadata.shard_offsets)
        return implementation(weight, self.group, self.table, geometry, context.round)

    def step_bytes(self, shard_shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> int:
        """What its optimizer's cross-shard form allocates at the peak of a step
        (:meth:`overlap_optim.cross_shard_base.CrossShardOptimizer.step_bytes`): for Adafactor no
        shard-sized gradient (it steps the touched rows), for LAMB, CAME and LARS the gradient and
        the shard-sized temporaries made from it, for Muon the whole matrix in the round; and the
        table's slot of the round."""
        implementation = cross_shard_class(self.group.optimizer_class)
        return implementation.step_bytes(self._geometry(), tuple(shard_shape), dtype)

    def state_layout(self) -> dict[str, str]:
        return sharded_state_layouts(self.group.spec, split_axis(self.decision.sharding_type))

    def runs_as(self) -> str:
        return "fallback: whole-table statistics across shards (1 all-reduce per step)"
