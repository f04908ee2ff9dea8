"""Data parallelism with in-backward optimizers: data-parallel tables, and ``DataParallelWrapper``.

- :class:`DataParallelTable` is the kind of a table replicated on every rank
  (``KernelKind.DATA_PARALLEL``): TorchRec's DDP all-reduces its gradient, and
  its annotated ``torch.optim`` steps in our DDP comm hook, on the averaged
  gradient, with dense semantics. A float32 table only: an FP16 or BF16 one is
  the replicated kind (:mod:`sharders.replicated`), which takes its kernel out of DDP
  (:func:`without_tables`).
- :class:`DataParallelWrapper` wraps the unsharded part of a DMP model in DDP,
  with the same hook.
- :class:`FullyShardWrapper` shards it with FSDP2 instead
  (:func:`overlap_optim.fully_shard`): each annotated dense parameter steps on
  its shard right after its reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DataParallelWrapper as TorchRecDataParallelWrapper
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardedModule, ShardingEnv

import overlap_optim

from overlap_optim.annotation import carry_over
from overlap_optim.clipping import join_clipping
from overlap_optim.comm_hooks import OptimizerHookState
from overlap_optim.ddp import install_optimizer_hook, register_optimizer_hook
from overlap_optim.local_sgd import QSR
from overlap_optim.record import annotate, live_optimizers, set_live_optimizers
from overlap_optim.spec import AnnotationGroup
from sharders import _private
from sharders.kernels import BuildContext, KernelKind, TableKernel
from sharders.evictions import refuse_managed_collision
from sharders.two_dimensional import refuse_two_dimensional

__all__ = ["DataParallelTable", "DataParallelWrapper", "FullyShardWrapper", "without_tables", "attach_optimizer"]


class DataParallelTable(TableKernel):
    """A data-parallel table: its annotated optimizer steps in the DDP hook, after the all-reduce."""

    kind = KernelKind.DATA_PARALLEL
    semantics = "dense"
    family = "data_parallel_hook"
    compute_kernel = None  # the plan's own
    plan_kernels = frozenset({"dense"})
    sharded_state = False  # the weight carries its annotation: get_optimizers finds it as a parameter
    low_precision_state = True  # the DDP hook's steps keep state_dtype (overlap_optim.state_precision)
    # Float32 only: autograd gives an FP16/BF16 weight a gradient in that dtype, which DDP would reduce and
    # torch.optim step in it. Such tables are the replicated kind (sharders.replicated).

    @classmethod
    def install(cls, tables: list[TableKernel], context: BuildContext) -> None:
        """Step each data-parallel table's optimizer on its all-reduced gradient."""
        names = {table.table for table in tables}
        for lookup in _private.lookups(context.sharded):
            if not isinstance(lookup, DistributedDataParallel):
                continue
            targets: dict[int, list] = {}
            managed, clips = [], {}
            for kernel in _private.kernels_of_lookup(lookup.module):
                if kernel.config.embedding_tables[0].name not in names:
                    continue  # unannotated tables keep their averaged gradient for the user; frozen ones have none
                flat = kernel.emb_module.weights
                managed.append(flat)
                for table, view in _table_views(kernel):
                    weight = context.table_module(table).weight
                    attach_optimizer(weight, context.tables[table].group)
                    clip = context.tables[table].clip
                    join_clipping(weight, clip)
                    if clip is not None:
                        clips.setdefault(id(clip), clip)  # in the tables' order: the same on every rank
                    targets.setdefault(id(flat), []).append((weight, view))
            if targets:
                state = OptimizerHookState(context.process_group, targets, managed, clips=list(clips.values()))
                install_optimizer_hook(lookup, state)

    def held_state(self, metadata: Any, weight: torch.Tensor | None) -> dict[str, Any]:
        """The state of the weight's own optimizer, which the DDP hook steps."""
        optimizers = (live_optimizers(weight) or []) if weight is not None else []
        return dict(optimizers[0].state.get(weight, {})) if optimizers and hasattr(optimizers[0], "state") else {}

    def state_bytes(self, shard_shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> int:
        """Every rank holds the whole table's state."""
        return super().state_bytes(self.decision.shape, dtype)

    def runs_as(self) -> str:
        return "torch.optim after all-reduce (DDP hook)"

    def why_not_fused(self) -> str:
        return ""


def _table_views(kernel: nn.Module) -> Iterator[tuple[str, Any]]:
    emb = kernel.emb_module
    for t_idx, (rows, dim) in enumerate(emb.embedding_specs):
        start = emb.weights_physical_offsets[t_idx]
        name = kernel.config.embedding_tables[t_idx].name
        yield name, (lambda g, s=start, r=rows, d=dim: g[s : s + r * d].view(r, d))


def attach_optimizer(weight: torch.Tensor, group: AnnotationGroup) -> None:
    """Annotate a sharded table's parameter with ``group`` and give it a live optimizer, which keeps
    its state where ``get_optimizers`` finds a parameter's (no grad hook: a DDP hook or a kernel steps it)."""
    annotate(weight, group)
    set_live_optimizers(weight, [group.spec.make([weight])])
    group.param_group["params"].append(weight)


def without_tables(lookup: DistributedDataParallel, names: set[str]) -> nn.Module:
    """The data-parallel ``lookup`` without the weights of its kernels of the tables ``names``:
    those weights no longer require grad, and the lookup is wrapped again by DDP (with the
    arguments TorchRec used) over what still trains, or unwrapped if nothing in it trains (the
    frozen kind, and the replicated kind, whose kernels reduce their own gradients)."""
    taken = [
        kernel for kernel in _private.kernels_of_lookup(lookup.module)
        if kernel.config.embedding_tables[0].name in names
    ]
    if not taken:
        return lookup
    for kernel in taken:
        kernel.emb_module.weights.requires_grad_(False)
    if not any(p.requires_grad for p in lookup.module.parameters()):
        return lookup.module
    return DistributedDataParallel(
        lookup.module,
        device_ids=lookup.device_ids,
        process_group=lookup.process_group,
        gradient_as_bucket_view=lookup.gradient_as_bucket_view,
        broadcast_buffers=lookup.broadcast_buffers,
        static_graph=lookup.static_graph,
    )


class DataParallelWrapper(DefaultDataParallelWrapper):
    """What ``DistributedModelParallel(data_parallel_wrapper=...)`` takes.

    It wraps the unsharded part of the model in DDP exactly as TorchRec's
    ``DefaultDataParallelWrapper`` does (same arguments), then installs
    :func:`overlap_optim.register_optimizer_hook`, so each annotated dense
    parameter is updated by its optimizer right after its bucket is all-reduced
    and averaged. Unannotated parameters keep their averaged gradient.

    A model with a managed-collision collection that DMP did not shard with our managed-collision
    sharders is refused here, naming it (:mod:`sharders.evictions`).

    A model built on the meta device keeps its annotations: DMP's
    ``init_parameters`` replaces each meta parameter with a new one, and the
    wrapper annotates the new parameter as its predecessor was (by FQN), from
    the record each module keeps of its annotated meta parameters
    (:func:`overlap_optim.annotation.carry_over`).

    Example:
        >>> model = DistributedModelParallel(model, plan=plan, sharders=[sharder],
        ...                                  data_parallel_wrapper=DataParallelWrapper())
    """

    def __init__(self, *args, local_sgd: QSR | None = None, **kwargs) -> None:
        """``local_sgd``: an ``overlap_optim.QSR``, local SGD for the data-parallel part (dense
        layers and data-parallel tables); sharded tables stay synchronous."""
        super().__init__(*args, **kwargs)
        self.local_sgd = local_sgd

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        refuse_two_dimensional(env)
        refuse_managed_collision(dmp.module, {})
        carry_over(dmp.module)  # before DDP takes the parameters that init_parameters made
        with _private.comm_hook_left_to_us(self) as comm:  # else TorchRec registers its own compress hook
            super().wrap(dmp, env, device)
        wrapped = _private.wrapped_module(dmp)
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            register_optimizer_hook(wrapped, comm=comm, local_sgd=self.local_sgd)


class FullyShardWrapper(TorchRecDataParallelWrapper):
    """What ``DistributedModelParallel(data_parallel_wrapper=...)`` takes to shard the unsharded
    part of the model with FSDP2 instead of replicating it under DDP.

    It applies :func:`overlap_optim.fully_shard` to the model DMP wraps, with every parameter of
    the sharded modules (the tables, data-parallel ones included: TorchRec's lookups reduce
    those) in ``ignored_params``; the annotated dense parameters keep their annotations and
    step on their shards right after each reduce-scatter. One ``get_optimizers(model)``
    covers the tables and the dense part. A model built on the meta device keeps its
    annotations, as with :class:`DataParallelWrapper`.

    Args:
        mesh: the 1-D device mesh (torch's default: every rank).
        **fully_shard_kwargs: torch's ``fully_shard`` settings, checked by
            :func:`overlap_optim.fully_shard`.

    Example:
        >>> model = DistributedModelParallel(model, plan=plan, sharders=[sharder],
        ...                                  data_parallel_wrapper=FullyShardWrapper(mesh=mesh))
    """

    def __init__(self, mesh: Any = None, **fully_shard_kwargs: Any) -> None:
        if "ignored_params" in fully_shard_kwargs:
            raise ValueError("FullyShardWrapper: ignored_params is set by the wrapper (every sharded table's)")
        self.mesh, self.kwargs = mesh, fully_shard_kwargs

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        refuse_two_dimensional(env)
        refuse_managed_collision(dmp.module, {})
        carry_over(dmp.module)
        module = _private.wrapped_module(dmp)
        if isinstance(module, torch.distributed.fsdp.FSDPModule):
            return
        ignored = {p for m in module.modules() if isinstance(m, ShardedModule) for p in m.parameters()}
        overlap_optim.fully_shard(module, mesh=self.mesh, ignored_params=ignored, **self.kwargs)
