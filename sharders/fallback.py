"""The fallback compute kernel: FBGEMM's dense lookup, then torch.optim on the touched rows.

For tables whose optimizer FBGEMM cannot compute exactly (see
:mod:`sharders.optimizer_table`), the sharder builds TorchRec's dense kernel
(``BatchedDenseEmbeddingBag``, or ``BatchedDenseEmbedding`` for an EC, whose
weights, state-dict and checkpoint plumbing we keep) and turns it into a
:class:`FallbackEmbeddingBag` (:class:`FallbackEmbedding`) that runs :class:`RowUpdates`. Its forward is the dense kernel's lookup without an
autograd graph on the weights; its backward turns the output gradient (pooled
or not: :mod:`sharders.pooling`) into one summed gradient per
touched row, and runs each table's :class:`~overlap_optim.table_optimizer.RowOptimizer`
(lazy: no gradient the size of a table is ever made, the cost follows the
touched rows), or, for an optimizer that is not row-separable, its
:class:`~overlap_optim.table_optimizer.DenseTableOptimizer` (dense: the whole shard steps).
In a gradient clipping set (:mod:`overlap_optim.clipping`), the summed row
gradients are clipped first: by value at once, by norm at the end of backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torchrec.distributed.batched_embedding_kernel import BatchedDenseEmbedding, BatchedDenseEmbeddingBag
from torchrec.optim.fused import EmptyFusedOptimizer
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from overlap_optim.accumulation import window_of_module
from overlap_optim.clipping import GradientClipping
from overlap_optim.gradient_path import Keep, take
from overlap_optim.record import live_optimizers, set_live_optimizers
from overlap_optim.table_optimizer import (
    DenseTableOptimizer, RowOptimizer, TableOptimizer, copy_bytes, math_dtype, step_tables, sum_rows,
)
from sharders import _private
from sharders.kernels import BuildContext, KernelKind, LocalShard, TableKernel
from sharders.pooling import (
    LOW_PRECISION, is_pooled, pooled_lookup, unpooled_lookup, value_grads, variable_batch_lookup,
)

__all__ = [
    "RowUpdates", "FallbackEmbeddingBag", "FallbackEmbedding", "FallbackOptimizer", "FallbackTable", "LazyTable",
    "DenseTable",
]


# Tables of a fallback kernel step in chunks of about this many bytes of summed row gradients
# (about 1/3 of the rows, state included, that a chunk's update gathers). Not a tuning knob:
# it keeps one step's temporaries small, so that glibc does not return them to the system at
# the end of each step and fault them in again at the next (benchmarks/virtual_groups.py).
STEP_BYTES = 2 << 20


class FallbackTable(TableKernel):
    """The kinds whose tables run in the fallback kernel: torch.optim's own step, from backward.

    Every fallback table whose settings differ from another's only in floats may share one
    kernel (one lookup, one multi-tensor update per virtual group)."""

    family = "fallback"
    compute_kernel = "dense"

    def batch_key(self) -> Hashable:
        # One kernel's tables step together: they share a clipping set (or none).
        return ("fallback", self.group.spec.share_key, id(self.clip))

    def make_optimizer(self, weight: torch.Tensor, config: Any, context: BuildContext) -> TableOptimizer:
        """The optimizer of this rank's shard ``weight`` (TorchRec's table ``config`` places it)."""
        raise NotImplementedError

    @classmethod
    def adopt(cls, kernel: nn.Module, tables: list[TableKernel], context: BuildContext) -> None:
        configs = kernel.config.embedding_tables
        makers = [lambda w, t=t, c=c: t.make_optimizer(w, c, context) for t, c in zip(tables, configs)]
        updates = RowUpdates.adopt(kernel, makers, tables[0].clip, context.sharded)
        for table, config, rows in zip(tables, configs, updates.row_optimizers):
            table.shards.append(LocalShard(config.local_metadata, rows))
        # TorchRec combined its kernels' fused optimizers before we saw them; add ours,
        # keyed as TorchRec keys the fused ones, so DMP's fused_optimizer covers them too.
        optimizer = updates.optimizer()
        optimizer.params = {f"{context.tables_attr}.{k}": v for k, v in optimizer.params.items()}
        _private.add_fused_optimizer(context.sharded, optimizer)

    @classmethod
    def install(cls, tables: list[TableKernel], context: BuildContext) -> None:
        """Mark each table's weight as TorchRec marks a fused one, the empty placeholder of a
        table held on other ranks included, so that TorchRec's ``in_backward_optimizer_filter``
        keeps it from the user's optimizer: ``CombinedOptimizer([model.fused_optimizer, user])``
        then sees each key once."""
        for table in tables:
            weight = context.table_module(table.table).weight
            if live_optimizers(weight) is None:
                set_live_optimizers(weight, [EmptyFusedOptimizer()])

    def check_live(self) -> None:
        self.group.spec.check_live(self.group.param_group, f"table {self.table!r}")

    def why_no_variable_batch(self) -> str | None:
        return None  # the pooled lookup takes FBGEMM's VBE layout; its gradient is read back per bag

    def state_layout(self) -> dict[str, str]:
        spec = self.group.spec
        return {n: spec.state[n].layout for n in spec.row_keys()}

    def scalar_names(self) -> list[str]:
        layout = self.state_layout()
        return [n for n in self.group.spec.state if n not in layout]



class LazyTable(FallbackTable):
    """torch.optim on the rows a batch touched (:class:`overlap_optim.table_optimizer.RowOptimizer`)."""

    kind = KernelKind.LAZY
    semantics = "lazy"
    # Rows read in float32, stepped in float32 with float32 state, rounded once when written back.
    precisions = frozenset({torch.float32, torch.float16, torch.bfloat16})
    low_precision_state = True  # its rows' state kept in state_dtype, read in float32

    def make_optimizer(self, weight: torch.Tensor, config: Any, context: BuildContext) -> TableOptimizer:
        return RowOptimizer(weight, self.group, self.table)

    def runs_as(self) -> str:
        # Adam on a float32 CPU table: in one compiled pass where the extension is built (overlap_optim.row_pass)
        one_pass = bool(self.shards) and all(shard.state.one_pass for shard in self.shards)
        return "fallback: torch.optim on touched rows" + (", in one compiled pass" if one_pass else "")


class DenseTable(FallbackTable):
    """torch.optim on the whole shard, untouched rows on a zero gradient
    (:class:`overlap_optim.table_optimizer.DenseTableOptimizer`)."""

    kind = KernelKind.DENSE
    semantics = "dense"
    # The shard stepped as a float32 copy made for the step, rounded once into the table after it;
    # state_dtype state stepped as float32 copies, rounded once into the stored state after it.
    precisions = frozenset({torch.float32, torch.float16, torch.bfloat16})
    low_precision_state = True

    def make_optimizer(self, weight: torch.Tensor, config: Any, context: BuildContext) -> TableOptimizer:
        return DenseTableOptimizer(weight, self.group, self.table)

    def step_bytes(self, shard_shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> int:
        """Each step makes the shard's whole gradient (zeros where untouched), float32 for an FP16 or
        BF16 shard, and then that shard's float32 copy."""
        gradient = shard_shape[0] * shard_shape[1] * math_dtype(dtype).itemsize
        return gradient + copy_bytes(tuple(shard_shape), dtype)

    def runs_as(self) -> str:
        return "fallback: torch.optim on the whole table"


class RowUpdates:
    """What a fallback kernel runs: its lookup with no graph on the weights, and, in backward,
    torch.optim on each table's touched rows. Build one with :meth:`adopt`.

    ``row_optimizers[i]`` updates the kernel's i-th table (shard), a ``(rows, dim)`` view of
    the dense kernel's weights.
    """

    def __init__(
        self,
        kernel: nn.Module,
        row_optimizers: list[TableOptimizer],
        clipping: GradientClipping | None = None,
        owner: nn.Module | None = None,
    ) -> None:
        self.kernel, self.row_optimizers, self.clipping, self.owner = kernel, row_optimizers, clipping, owner
        # how the model's window keeps the kernel's gradients: each table's touched rows, summed
        self.keep = Keep(self, add=_add_rows, own=_summed_rows, tensors=lambda rows: [rows[1]])
        self.layout = _private.dense_kernel_layout(kernel)
        self.pooling_mode = kernel.emb_module.pooling_mode
        # Nothing of the weights is in the graph; the anchor lets backward reach the kernel.
        kernel.emb_module.weights.requires_grad_(False)
        self.anchor = torch.empty(0, requires_grad=True)

    @classmethod
    def adopt(
        cls,
        dense: nn.Module,
        tables: list[Callable[[torch.Tensor], TableOptimizer]] = (),
        clipping: GradientClipping | None = None,
        owner: nn.Module | None = None,
    ) -> RowUpdates:
        """Turn TorchRec's dense kernel ``dense`` (pooled or not) into a fallback kernel in place,
        and return what it runs.

        TorchRec's lookup builds kernels from a closed switch with no registry,
        and registers the tables' parameters before a sharder sees the result,
        so the kernel object is kept (weights, views and all) and only its
        class changes.

        Args:
            dense: a kernel built for compute kernel "dense".
            tables: for each table (shard) of the kernel, in order, a function from its weight
                to its table optimizer.
            clipping: the gradient clipping set of the kernel's tables, or None.
            owner: the sharded module, whose model's ``no_step`` window holds the updates back (None: never).
        """
        _private.recast_kernel(dense, _FALLBACK_OF[type(dense)])
        weights = dense.emb_module.split_embedding_weights()
        dense.row_updates = cls(dense, [make(w) for make, w in zip(tables, weights)], clipping, owner)
        return dense.row_updates

    def optimizer(self) -> FallbackOptimizer:
        """The kernel's tables as TorchRec's ``KeyedOptimizer``, keyed ``<table>.weight``."""
        params = dict(self.kernel.named_parameters_by_table())
        names = [t.name for t in self.kernel.config.embedding_tables]
        # The annotation groups' own dicts: an LR schedule reaches the next backward.
        param_groups = list({id(r.group): r.group.param_group for r in self.row_optimizers}.values())
        return FallbackOptimizer({f"{n}.weight": params[n] for n in names}, self.row_optimizers, param_groups)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        tables = [t.name for t in self.kernel.config.embedding_tables]
        batches = features.stride_per_key_per_rank() if features.variable_stride_per_key() else None
        if batches is not None and not is_pooled(self.pooling_mode):
            raise NotImplementedError(f"fallback tables {tables}: variable batch size per feature is not supported "
                                      "for an EmbeddingCollection")
        weights = features.weights_or_none()
        if weights is not None and not torch.is_floating_point(weights):
            weights = None
        if weights is not None and weights.requires_grad:
            raise NotImplementedError(
                f"fallback tables {tables}: per-sample weights that require grad (feature processors) are not supported"
            )
        indices = features.values().to(self.layout.index_dtype)
        offsets = features.offsets().to(self.layout.offset_dtype)
        return _LookupThenUpdate.apply(self.anchor, self, indices, offsets, weights, batches)

    def lookup(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
        batches: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """The kernel's output for a batch, pooled or not (:mod:`sharders.pooling`); with
        ``batches`` (each feature's bags per rank: VBE), FBGEMM's flat VBE layout."""
        emb = self.kernel.emb_module
        if batches is not None:
            return variable_batch_lookup(emb.split_embedding_weights(), self.layout.feature_table_map, indices,
                                         offsets, weights, batches, self.pooling_mode)
        if is_pooled(self.pooling_mode):
            if emb.weights.dtype in LOW_PRECISION:  # FBGEMM's CPU TBE has no BF16 lookup; rows read in float32
                return pooled_lookup(emb.split_embedding_weights(), self.layout.feature_table_map, indices, offsets,
                                     weights, self.pooling_mode)
            return emb(indices=indices, offsets=offsets, per_sample_weights=weights)
        return unpooled_lookup(emb.split_embedding_weights(), self.layout.feature_table_map, indices, offsets)

    @torch.no_grad()
    def update_rows(
        self, grad_out: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
        batches: list[list[int]] | None = None,
    ) -> None:
        """Sum the gradient of every touched row of every table, then step each table once
        (after clipping the sums, in a clipping set), by the gradient path: inside ``no_step``
        the window keeps the sums, and the window's last micro-batch steps on the sums of all of
        them: a row is touched if any micro-batch touched it.

        With no clipping and no window to close, tables step as soon as their gradients are read,
        a few at a time (:data:`STEP_BYTES`), so that one step's temporaries stay the size of a
        few tables' touched rows, whatever the number of tables in the kernel; a table that steps
        in one compiled pass (:mod:`overlap_optim.row_pass`) sums its repeated ids as it goes."""
        dims = [r.weight.shape[1] for r in self.row_optimizers]
        features = value_grads(
            self.pooling_mode, self.layout.feature_table_map, dims, grad_out, indices, offsets, weights, batches
        )
        # each shard's rows are its own: no rank holds them alike
        take(self._step_as_read, self._row_grads(features, indices, grad_out), clip=self.clipping,
             window=None if self.owner is None else window_of_module(self.owner), keep=self.keep)

    def _step_as_read(self, touched: Iterable[tuple[int, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Step the tables as their gradients are read, a few at a time (:data:`STEP_BYTES` of
        them): one pass, or one multi-tensor update per virtual group of a chunk. Rows the window
        or clipping summed (:class:`_Summed`) step as they are, in the chunk under way (held
        already, they count for no chunk); the others are summed first, unless their table steps
        in one pass, which sums a repeated id's gradients as it goes."""
        chunk, size = [], 0
        for table, rows in touched:
            optimizer = self.row_optimizers[table]
            if isinstance(rows, _Summed):  # held already: stepping it sooner frees nothing
                chunk.append((optimizer, *rows))
                continue
            chunk.append((optimizer, *(rows if optimizer.one_pass else sum_rows(*rows))))
            size += rows[1].numel() * rows[1].element_size()
            if size >= STEP_BYTES:
                step_tables(chunk)
                chunk, size = [], 0
        if chunk:
            step_tables(chunk)

    def _row_grads(
        self, features: Iterator[tuple[torch.Tensor, torch.Tensor, int]], indices: torch.Tensor, grad_out: torch.Tensor
    ) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
        """``(table, (row ids, a gradient per id))`` for every table of the kernel, once each, as
        soon as its last feature is read; ids may repeat."""
        last = {table: f for f, table in enumerate(self.layout.feature_table_map)}
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {t: [] for t in range(len(self.row_optimizers))}
        for f, (ids, grads, table) in enumerate(features):
            parts[table].append((ids, grads))
            if last[table] == f:
                yield table, _joined(parts.pop(table), indices, grad_out, self.row_optimizers[table].weight.shape[1])
        for table in sorted(parts):  # tables no feature of this batch reached (an empty batch)
            yield table, _joined(parts.pop(table), indices, grad_out, self.row_optimizers[table].weight.shape[1])


class _Summed(tuple):
    """A table's (unique ids, each one's summed gradient)."""


def _summed_rows(rows: tuple[torch.Tensor, torch.Tensor]) -> _Summed:
    """(ids, a gradient per id) as (unique ids, each one's summed gradient)."""
    return rows if isinstance(rows, _Summed) else _Summed(sum_rows(*rows))


def _add_rows(kept: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor]) -> _Summed:
    """The window's sums of a table's rows with a micro-batch's (ids may repeat) added."""
    return _Summed(sum_rows(torch.cat([kept[0], new[0]]), torch.cat([kept[1], new[1]])))


def _joined(
    parts: list[tuple[torch.Tensor, torch.Tensor]], indices: torch.Tensor, grad_out: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, their gradients) of ``parts`` of (ids, gradients), in one pair."""
    if len(parts) == 1:  # most often: one feature per table, no window; no copy
        return parts[0]
    ids = torch.cat([p[0] for p in parts]) if parts else indices.new_zeros(0)
    grads = torch.cat([p[1] for p in parts]) if parts else grad_out.new_zeros(0, dim)
    return ids, grads


class FallbackEmbeddingBag(BatchedDenseEmbeddingBag):
    """TorchRec's dense kernel of an EmbeddingBagCollection (pooled), running its ``row_updates``."""

    row_updates: RowUpdates

    def forward(self, features: KeyedJaggedTensor, *unused: Any) -> torch.Tensor:
        return self.row_updates.forward(features)


class FallbackEmbedding(BatchedDenseEmbedding):
    """TorchRec's dense kernel of an EmbeddingCollection (unpooled), running its ``row_updates``."""

    row_updates: RowUpdates

    def forward(self, features: KeyedJaggedTensor, *unused: Any) -> torch.Tensor:
        return self.row_updates.forward(features)


_FALLBACK_OF: dict[type, type[nn.Module]] = {
    BatchedDenseEmbeddingBag: FallbackEmbeddingBag, BatchedDenseEmbedding: FallbackEmbedding,
}


class FallbackOptimizer(KeyedOptimizer):
    """The fallback tables of one kernel as a TorchRec ``KeyedOptimizer``.

    This is TorchRec's view (``model.fused_optimizer``): state is each local
    shard's state under torch.optim's names. ``param_groups`` are the tables'
    annotation groups, live. ``step()`` and ``zero_grad()`` do no work: backward
    did it. The plan-independent view is ``overlap_optim.get_optimizers``.
    """

    def __init__(self, params: dict[str, torch.Tensor], rows: list[TableOptimizer], param_groups: list[dict]) -> None:
        super().__init__(params, _RowState(list(params.values()), rows), param_groups)

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


class _RowState(Mapping):
    """``table param -> its RowOptimizer state``, read live; tables not yet stepped are absent."""

    def __init__(self, params: list[torch.Tensor], rows: list[TableOptimizer]) -> None:
        self._pairs = list(zip(params, rows))

    def __getitem__(self, param):
        for p, r in self._pairs:
            if p is param and r.state:
                return r.state
        raise KeyError(param)

    def __iter__(self):
        return (p for p, r in self._pairs if r.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _LookupThenUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, updates, indices, offsets, weights, batches):
        ctx.updates, ctx.weights, ctx.batches = updates, weights, batches
        ctx.save_for_backward(indices, offsets)
        return updates.lookup(indices, offsets, weights, batches)

    @staticmethod
    def backward(ctx, grad_out):
        indices, offsets = ctx.saved_tensors
        ctx.updates.update_rows(grad_out.contiguous(), indices, offsets, ctx.weights, ctx.batches)
        return None, None, None, None, None, None
