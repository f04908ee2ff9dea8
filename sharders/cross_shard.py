"""The cross-shard table kind: a split table whose layer-wise optimizer has a cross-shard form.

Its shards run in the fallback kernel (:mod:`sharders.fallback`) and meet in the
module's end-of-backward round: one all-reduce of whole-table statistics per
step, whatever the number of such tables. The per-shard math is the core's
(:mod:`overlap_optim.cross_shard`), shared with FSDP2's parameter shards.
"""

from __future__ import annotations

from typing import Any

import torch

from overlap_optim.cross_shard import CrossShardOptimizer, Geometry, cross_shard_class, sharded_state_layouts
from overlap_optim.round import EndOfBackwardRound
from sharders.fallback import FallbackTable
from sharders.kernels import BuildContext, KernelKind, split_axis

__all__ = ["CrossShardTable"]


class CrossShardTable(FallbackTable):
    """The kind of a split table whose layer-wise optimizer has a cross-shard form: its shards
    run in the fallback kernel and meet in the module's end-of-backward round."""

    kind = KernelKind.CROSS_SHARD

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
        """The shard-sized gradient, and the round's statistics: this table's slot of the float64
        buffer and the partial sums handed to it (for Muon, the whole matrix, twice)."""
        slot = cross_shard_class(self.group.optimizer_class).slot_size(self._geometry())
        return super().step_bytes(shard_shape, dtype) + 2 * 8 * slot

    def state_layout(self) -> dict[str, str]:
        return sharded_state_layouts(self.group.spec, split_axis(self.decision.sharding_type))

    def runs_as(self) -> str:
        return "fallback: whole-table statistics across shards (1 all-reduce per step)"
