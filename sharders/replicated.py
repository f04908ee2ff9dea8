"""The replicated kind: a data-parallel table stored in FP16 or BF16.

Every rank holds the whole table. The float32 data-parallel path (TorchRec's DDP over the
lookup, our DDP hook) cannot step such a table exactly: autograd gives an FP16 weight an FP16
gradient (FBGEMM's dense backward writes it in the weight's dtype), which DDP would reduce and
``torch.optim`` step in FP16. This kind takes its kernels out of that DDP
(:func:`sharders.data_parallel.without_tables`) and runs them in the fallback
(:class:`sharders.fallback.RowUpdates`): the lookup reads rows in float32, and backward sums
each touched row's float32 gradient on this rank. Then, at the end of backward:

1. **Average.** Each table's float32 gradient (the whole table, zero where untouched) is
   summed across ranks in the module's SETTLE round (:mod:`overlap_optim.round`: one
   all-reduce for every such table, shared with the other rounds of that phase) and divided
   by the world size: DDP's average, the gradient of the global batch.
2. **Gradient path.** It goes through :func:`overlap_optim.gradient_path.take`, replicated
   (rank 0 alone adds it to a clipping norm). Inside ``no_step`` nothing is reduced: each rank
   keeps its own sum, and the window's last micro-batch reduces and steps once.
3. **Step.** ``torch.optim`` steps a float32 copy of the whole table made for the step, with
   float32 state (or the annotation's ``state_dtype``, rounded after each step), and the result
   is rounded once into the table, to nearest even. Dense semantics: every row steps.

The state is the weight's own, as for a float32 data-parallel table: the live optimizer on the
table's weight keeps it under that weight, where ``get_optimizers`` finds (and loads) a
parameter's state, keyed by the weight's FQN.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from overlap_optim.accumulation import window_of_module
from overlap_optim.clipping import join_clipping
from overlap_optim.gradient_path import Keep, take
from overlap_optim.round import EndOfBackwardRound, Phase
from overlap_optim.spec import AnnotationGroup
from overlap_optim.state_precision import in_float32, stored
from overlap_optim.table_optimizer import DenseTableOptimizer
from overlap_optim.update import drop_placeholder_state, live_optimizer, set_state_maker
from sharders import _private
from sharders.data_parallel import DataParallelTable, attach_optimizer, without_tables
from sharders.fallback import RowUpdates
from sharders.kernels import BuildContext, KernelKind, TableKernel
from sharders.pooling import value_grads

__all__ = ["ReplicatedTable", "ReplicatedRows", "ReplicatedTableOptimizer"]


class ReplicatedTable(DataParallelTable):
    """A data-parallel table stored in FP16 or BF16: the fallback kernel, its float32 gradient
    averaged across ranks in the module's SETTLE round, ``torch.optim`` on the whole table."""

    kind = KernelKind.REPLICATED
    family = "fallback"
    precisions = frozenset({torch.float16, torch.bfloat16})
    low_precision_state = True  # its state kept in state_dtype, read in float32 for each step

    def batch_key(self) -> Hashable:
        return (self.kind, id(self.clip))  # one kernel's tables share a clipping set (or none)

    @classmethod
    def install(cls, tables: list[TableKernel], context: BuildContext) -> None:
        """Take the tables' kernels out of the data-parallel lookup's DDP and run them in the
        fallback, their gradients averaged in a SETTLE round of the module (one slot a table,
        registered in table order: the same on every rank)."""
        names = {table.table for table in tables}
        round_ = EndOfBackwardRound(context.process_group, Phase.SETTLE)
        for table in tables:
            round_.register(table.table, math.prod(table.decision.shape))
        for i, lookup in enumerate(_private.lookups(context.sharded)):
            if not isinstance(lookup, DistributedDataParallel):
                continue
            kernels = [kernel for kernel in _private.kernels_of_lookup(lookup.module)
                       if kernel.config.embedding_tables[0].name in names]
            _private.replace_lookup(context.sharded, i, without_tables(lookup, names))
            for kernel in kernels:
                mine = [context.tables[config.name] for config in kernel.config.embedding_tables]
                makers = [functools.partial(table.make_optimizer, context=context) for table in mine]
                ReplicatedRows.adopt(kernel, makers, mine[0].clip, context.sharded).round = round_

    def make_optimizer(self, weight: torch.Tensor, context: BuildContext) -> ReplicatedTableOptimizer:
        """The optimizer of the table ``weight`` (the kernel's view); its state lives on the
        sharded module's weight of the table, which carries the annotation."""
        param = context.table_module(self.table).weight
        attach_optimizer(param, self.group)
        join_clipping(param, self.clip)
        return ReplicatedTableOptimizer(weight, self.group, self.table, param)

    def check_live(self) -> None:
        self.group.spec.check_live(self.group.param_group, f"table {self.table!r}")

    def step_bytes(self, shard_shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> int:
        """Every rank holds the whole table's float32 gradient and reduces it in the round: its
        slot, :meth:`~overlap_optim.round.EndOfBackwardRound.slot_bytes` of float32 partials (the
        gradient itself), 28 bytes an element. That is the step's peak: while the round finishes,
        the partials and the float64 buffer (12 bytes) stay with the averaged gradient and the
        float32 copy of the table made for the step (4 + 4), and a float64 quotient made on the
        way (8)."""
        return EndOfBackwardRound.slot_bytes(math.prod(self.decision.shape), torch.float32)

    def runs_as(self) -> str:
        return "fallback: torch.optim on the whole table, gradient averaged across ranks"


class ReplicatedTableOptimizer(DenseTableOptimizer):
    """The whole table every rank holds, stepped as :class:`DenseTableOptimizer` steps a
    low-precision table (a float32 copy made for the step, rounded once after it), on a
    gradient given whole (:meth:`step_whole`).

    Its state is kept by the live optimizer of ``param`` (the sharded module's weight of the
    table), under ``param``, in float32 or the annotation's ``state_dtype``: ``get_optimizers``
    saves and loads it as a parameter's, with the placeholder rule of
    :mod:`overlap_optim.update` (its placeholder is a step on a zero gradient, the table put back).

    Args:
        weight: the table, ``(rows, dim)``, FP16 or BF16; updated in place.
        group: its annotation.
        name: the table's name, for errors.
        param: the tensor that carries the annotation and keys the state (the same storage as ``weight``).
    """

    def __init__(self, weight: torch.Tensor, group: AnnotationGroup, name: str, param: torch.Tensor) -> None:
        # Before the base class: state an optimizer makes when built (Adagrad's sum), made for the float32
        # copy, is the table's, set under ``param`` (the live optimizer, built on the stored weight, made it
        # in the stored dtype).
        self.param = param
        super().__init__(weight, group, name)
        set_state_maker(param, self._make_placeholder)

    @torch.no_grad()
    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        self.step_whole(self.whole_gradient(ids, grads))

    @torch.no_grad()
    def step_whole(self, grad: torch.Tensor) -> None:
        """Step the whole table on ``grad`` (float32, the table's shape), its state read in
        float32 and written back in its own dtype."""
        state = self.ready()
        stepped = self.stepped
        stepped.data = self.weight.to(self.math_dtype)
        stepped.grad = grad
        try:
            with in_float32([state], [self.group.state_dtype]) as (work,):
                self._optimizer.state[stepped] = work
                self.group.step(self._optimizer, stepped)
            self.weight.copy_(stepped)  # the one rounding, to nearest even
        finally:
            self._optimizer.state.pop(stepped, None)
            stepped.grad = None
            self._release()

    def ready(self) -> dict[str, Any]:
        """Check the live settings, drop the weight's placeholder state; its state, to update in place."""
        self.group.spec.check_live(self.param_group, f"table {self.name!r}")
        drop_placeholder_state(self.param)
        return live_optimizer(self.param).state[self.param]

    @property
    def state(self) -> dict[str, Any]:
        return dict(live_optimizer(self.param).state.get(self.param, {}))

    def _clear_state(self) -> None:
        live_optimizer(self.param).state.pop(self.param, None)

    def _set_state(self, state: dict[str, Any]) -> None:
        live_optimizer(self.param).state[self.param] = {k: stored(v, self.group.state_dtype) for k, v in state.items()}


class ReplicatedRows(RowUpdates):
    """What a replicated kernel runs: the fallback's lookup, and a backward that sums this rank's
    float32 gradient of each table and hands it to :attr:`round`, which averages it across ranks
    and steps each table (:class:`ReplicatedTableOptimizer`) by the gradient path."""

    round: EndOfBackwardRound  # the module's SETTLE round, with a slot per table (set by ReplicatedTable)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keep = Keep(self, add=lambda kept, new: kept.add_(new))  # each table's whole gradient, summed

    @torch.no_grad()
    def update_rows(
        self, grad_out: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
        batches: list[list[int]] | None = None,
    ) -> None:
        """This rank's float32 gradient of each table, whole (zero where untouched), by the
        gradient path to the round: inside ``no_step`` the window keeps it, and the micro-batch
        that closes the window hands the round the window's sum."""
        tables = [r.weight for r in self.row_optimizers]
        grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in tables]
        features = value_grads(self.pooling_mode, self.layout.feature_table_map, [t.shape[1] for t in tables],
                               grad_out, indices, offsets, weights, batches)
        for ids, rows, table in features:
            grads[table].index_add_(0, ids, rows.to(torch.float32))
        take(self._contribute, enumerate(grads), clip=None,
             window=None if self.owner is None else window_of_module(self.owner), keep=self.keep)

    def _contribute(self, grads: Iterable[tuple[int, torch.Tensor]]) -> None:
        """Hand each table's gradient to the round, which averages it across ranks."""
        self.round.arm()
        for table, grad in grads:
            rows = self.row_optimizers[table]
            self.round.contribute(rows.name, grad, functools.partial(self._averaged, rows))

    def _averaged(self, rows: ReplicatedTableOptimizer, summed: torch.Tensor) -> None:
        """The round's finish: the sum over ranks divided by their number (in float64, rounded
        once to float32), through the gradient path to the step. Every rank holds it alike."""
        world = dist.get_world_size(self.round.process_group) if dist.is_initialized() else 1
        grad = torch.div(summed.view(rows.weight.shape), world).to(torch.float32)
        take(lambda grads: rows.step_whole(grads[0]), [grad], clip=self.clipping, replicated=True)
