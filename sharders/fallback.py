"""The fallback compute kernel: FBGEMM's dense lookup, then torch.optim on the touched rows.

For tables whose optimizer FBGEMM cannot compute exactly (see
:mod:`sharders.optimizer_table`), the sharder builds TorchRec's dense kernel
(``BatchedDenseEmbeddingBag``, whose weights, state-dict and checkpoint
plumbing we keep) and turns it into a :class:`FallbackEmbeddingBag`. Its
forward is the dense kernel's lookup without an autograd graph on the weights;
its backward turns the pooled output gradient into one summed gradient per
touched row, and runs each table's :class:`~overlap_optim.update.RowOptimizer`
(lazy: no gradient the size of a table is ever made, the cost follows the
touched rows), or, for an optimizer that is not row-separable, its
:class:`~overlap_optim.update.DenseTableOptimizer` (dense: the whole shard steps).
In a gradient clipping set (:mod:`overlap_optim.clipping`), the summed row
gradients are clipped first: by value at once, by norm at the end of backward.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torchrec.distributed.batched_embedding_kernel import BatchedDenseEmbeddingBag
from torchrec.optim.fused import EmptyFusedOptimizer
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from overlap_optim.clipping import GradientClipping
from overlap_optim.update import DenseTableOptimizer, RowOptimizer, TableOptimizer, step_tables
from sharders import _private
from sharders.kernels import Accumulation, BuildContext, KernelKind, LocalShard, TableKernel

__all__ = ["FallbackEmbeddingBag", "FallbackOptimizer", "FallbackTable", "LazyTable", "DenseTable"]


class FallbackTable(TableKernel):
    """The kinds whose tables run in the fallback kernel: torch.optim's own step, from backward.

    Every fallback table whose settings differ from another's only in floats may share one
    kernel (one lookup, one multi-tensor update per virtual group)."""

    compute_kernel = "dense"

    def batch_key(self) -> Hashable:
        # One kernel's tables step together: they share a clipping set (or none).
        return ("fallback", self.group.spec.share_key, None if self.clip is None else self.clip.order)

    def make_optimizer(self, weight: torch.Tensor, config: Any, context: BuildContext) -> TableOptimizer:
        """The optimizer of this rank's shard ``weight`` (TorchRec's table ``config`` places it)."""
        raise NotImplementedError

    @classmethod
    def adopt(cls, kernel: nn.Module, tables: list[TableKernel], context: BuildContext) -> None:
        configs = kernel.config.embedding_tables
        makers = [lambda w, t=t, c=c: t.make_optimizer(w, c, context) for t, c in zip(tables, configs)]
        fallback = FallbackEmbeddingBag.adopt(kernel, makers, tables[0].clip, context.accumulation)
        for table, config, rows in zip(tables, configs, fallback.row_optimizers):
            table.shards.append(LocalShard(config.local_metadata, rows))
        # TorchRec combined its kernels' fused optimizers before we saw them; add ours,
        # keyed as TorchRec keys the fused ones, so DMP's fused_optimizer covers them too.
        optimizer = fallback.fallback_optimizer
        optimizer.params = {f"embedding_bags.{k}": v for k, v in optimizer.params.items()}
        _private.add_fused_optimizer(context.sharded, optimizer)

    @classmethod
    def install(cls, tables: list[TableKernel], context: BuildContext) -> None:
        """Mark each table's weight as TorchRec marks a fused one, the empty placeholder of a
        table held on other ranks included, so that TorchRec's ``in_backward_optimizer_filter``
        keeps it from the user's optimizer: ``CombinedOptimizer([model.fused_optimizer, user])``
        then sees each key once."""
        for table in tables:
            weight = context.sharded.embedding_bags[table.table].weight
            if not hasattr(weight, "_in_backward_optimizers"):
                weight._in_backward_optimizers = [EmptyFusedOptimizer()]

    def check_live(self) -> None:
        self.group.spec.check_live(self.group.param_group, f"table {self.table!r}")

    def state_layout(self) -> dict[str, str]:
        spec = self.group.spec
        return {n: spec.state[n].layout for n in spec.row_keys()}

    def scalar_names(self) -> list[str]:
        layout = self.state_layout()
        return [n for n in self.group.spec.state if n not in layout]


class LazyTable(FallbackTable):
    """torch.optim on the rows a batch touched (:class:`overlap_optim.update.RowOptimizer`)."""

    kind = KernelKind.LAZY

    def make_optimizer(self, weight: torch.Tensor, config: Any, context: BuildContext) -> TableOptimizer:
        return RowOptimizer(weight, self.group, self.table)

    def runs_as(self) -> str:
        return "fallback: torch.optim on touched rows"


class DenseTable(FallbackTable):
    """torch.optim on the whole shard, untouched rows on a zero gradient
    (:class:`overlap_optim.update.DenseTableOptimizer`)."""

    kind = KernelKind.DENSE

    def make_optimizer(self, weight: torch.Tensor, config: Any, context: BuildContext) -> TableOptimizer:
        return DenseTableOptimizer(weight, self.group, self.table)

    def runs_as(self) -> str:
        return "fallback: torch.optim on the whole table"


class FallbackEmbeddingBag(BatchedDenseEmbeddingBag):
    """A dense TorchRec kernel whose tables are updated in backward, row by touched row.

    Build it with :meth:`adopt`. ``row_optimizers[i]`` updates the kernel's
    i-th table (shard), a ``(rows, dim)`` view of the dense kernel's weights.
    """

    row_optimizers: list[TableOptimizer]
    clipping: GradientClipping | None
    accumulation: Accumulation

    @classmethod
    def adopt(
        cls,
        dense: BatchedDenseEmbeddingBag,
        tables: list[Callable[[torch.Tensor], TableOptimizer]],
        clipping: GradientClipping | None = None,
        accumulation: Accumulation | None = None,
    ) -> FallbackEmbeddingBag:
        """Turn ``dense`` into a fallback kernel in place and return it.

        TorchRec's lookup builds kernels from a closed switch with no registry,
        and registers the tables' parameters before a sharder sees the result,
        so the kernel object is kept (weights, views and all) and only its
        class changes.

        Args:
            dense: a kernel built for compute kernel "dense".
            tables: for each table (shard) of the kernel, in order, a function from its weight
                to its table optimizer.
            clipping: the gradient clipping set of the kernel's tables, or None.
            accumulation: the sharded module's ``no_step`` flag (None: never active).
        """
        assert isinstance(dense, BatchedDenseEmbeddingBag)
        dense.__class__ = cls
        weights = dense.emb_module.split_embedding_weights()
        names = [t.name for t in dense.config.embedding_tables]
        params = dict(dense.named_parameters_by_table())
        dense.row_optimizers = [make(w) for make, w in zip(tables, weights)]
        dense.clipping = clipping
        dense.accumulation = accumulation if accumulation is not None else Accumulation()
        dense._window = []  # per micro-batch of an open no_step window: each table's (rows, summed grads)
        # The annotation groups' own dicts: an LR schedule reaches the next backward.
        param_groups = list({id(r.group): r.group.param_group for r in dense.row_optimizers}.values())
        dense.fallback_optimizer = FallbackOptimizer(
            {f"{n}.weight": params[n] for n in names}, dense.row_optimizers, param_groups
        )
        # Nothing of the weights is in the graph; the anchor lets backward reach us.
        dense.emb_module.weights.requires_grad_(False)
        dense._anchor = torch.empty(0, requires_grad=True)
        return dense

    def forward(self, features: KeyedJaggedTensor, *unused: Any) -> torch.Tensor:
        if features.variable_stride_per_key():
            raise NotImplementedError(
                f"fallback tables {[t.name for t in self.config.embedding_tables]}: variable batch "
                "size per feature is not supported"
            )
        weights = features.weights_or_none()
        if weights is not None and not torch.is_floating_point(weights):
            weights = None
        if weights is not None and weights.requires_grad:
            raise NotImplementedError(
                f"fallback tables {[t.name for t in self.config.embedding_tables]}: per-sample weights "
                "that require grad (feature processors) are not supported"
            )
        layout = _private.dense_kernel_layout(self)
        indices = features.values().to(layout.index_dtype)
        offsets = features.offsets().to(layout.offset_dtype)
        return _LookupThenUpdate.apply(self._anchor, self, indices, offsets, weights)

    @torch.no_grad()
    def update_rows(
        self, grad_out: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None
    ) -> None:
        """Sum the gradient of every touched row of every table, then step each table once
        (after clipping the sums, in a clipping set). Inside ``no_step`` the sums are kept
        instead, and the window's last micro-batch steps on the sums of all of them: a row is
        touched if any micro-batch touched it."""
        per_table: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for ids, grads, table in self._value_grads(grad_out, indices, offsets, weights):
            per_table.setdefault(table, []).append((ids, grads))
        sums = []
        for table, rows in enumerate(self.row_optimizers):  # every table steps, touched or not
            parts = [*(window[table] for window in self._window), *per_table.get(table, [])]
            ids = torch.cat([p[0] for p in parts]) if parts else indices.new_zeros(0)
            grads = torch.cat([p[1] for p in parts]) if parts else grad_out.new_zeros(0, rows.weight.shape[1])
            unique, inverse = torch.unique(ids, return_inverse=True)
            summed = torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype, device=grads.device)
            summed.index_add_(0, inverse, grads)
            sums.append((unique, summed))
        if self.accumulation.active:
            self._window = [sums]  # the window so far, summed: it holds each touched row once
            return
        self._window = []
        updates = [(rows, unique, summed) for rows, (unique, summed) in zip(self.row_optimizers, sums)]
        if self.clipping is None:
            step_tables(updates)  # one multi-tensor update per virtual group of tables
        else:  # each shard's rows are its own: no rank holds them alike
            self.clipping.clip([u[2] for u in updates], lambda: step_tables(updates))

    def _value_grads(self, grad_out, indices, offsets, weights):
        """Per feature: (row ids, gradient of each looked-up value, table index)."""
        layout = _private.dense_kernel_layout(self)
        features = len(layout.feature_table_map)
        batch = (offsets.numel() - 1) // features
        if batch == 0:
            return
        lengths = offsets[1:] - offsets[:-1]
        bag_of_value = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)
        column = 0
        dims = [w.shape[1] for w in (r.weight for r in self.row_optimizers)]
        bounds = offsets[:: batch].tolist()  # where each feature's values start
        for f, table in enumerate(layout.feature_table_map):
            start, end = bounds[f], bounds[f + 1]
            dim = dims[table]
            samples = bag_of_value[start:end] - f * batch
            grads = grad_out[:, column : column + dim].contiguous().index_select(0, samples)
            if weights is not None:
                grads = grads * weights[start:end, None]
            if layout.pooling == PoolingMode.MEAN:
                grads = grads / lengths[f * batch + samples].clamp(min=1)[:, None]
            column += dim
            yield indices[start:end], grads, table


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
    def forward(ctx, anchor, kernel, indices, offsets, weights):
        ctx.kernel, ctx.weights = kernel, weights
        ctx.save_for_backward(indices, offsets)
        return kernel.emb_module(indices=indices, offsets=offsets, per_sample_weights=weights)

    @staticmethod
    def backward(ctx, grad_out):
        indices, offsets = ctx.saved_tensors
        ctx.kernel.update_rows(grad_out.contiguous(), indices, offsets, ctx.weights)
        return None, None, None, None, None
