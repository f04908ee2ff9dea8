"""An EmbeddingBagCollection sharder that gives every table exactly its torch.optim update.

It is TorchRec's sharder with three changes:

- Each table's annotation is translated by :mod:`sharders.optimizer_table`:
  fusable settings reach FBGEMM translated name by name (so tables with equal
  settings share one fused TBE), everything else goes to the fallback kernel
  (grouped by setting in the same way). Nothing untranslated reaches FBGEMM.
- Data-parallel tables are updated with their annotated optimizer from a
  DDP communication hook, after their gradients are all-reduced.
- Row-wise and table-row-wise sharding are offered on CPU too.

A fusable table can be pinned to the fallback, by name
(``fallback_tables=``) or by a plan that gives it compute kernel "dense";
any other kernel in the plan is replaced by the decision above.

Fused and fallback tables are lazy: on a batch that leaves rows untouched,
those rows and their state do not change. ``dense_tables=`` names tables that
step every row of their shard on every batch instead (a zero gradient where
untouched), exactly as ``torch.optim`` on a dense ``nn.EmbeddingBag``; they
run in the fallback, at a cost that follows the shard's size.

A table with no annotation gets TorchRec's dense kernel (or, data-parallel,
plain DDP): its gradient is handed back on the sharded weight's ``.grad`` for
the user's own optimizer (see ``overlap_optim.unoptimized_parameters``); stock
TorchRec would silently train it with FBGEMM's default SGD.

Refused at sharding time, with the table's name: an optimizer that needs a
closure, and a table split into row (column) shards whose optimizer the
optimizer model (:mod:`overlap_optim.spec`) finds not separable by rows
(columns): Adafactor, Muon, CAME, and torchrec's ``RowWiseAdagrad`` on column
shards. A whole table whose optimizer is not row-separable runs with dense
semantics in the fallback.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as _TorchRecSharder
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.fused import EmptyFusedOptimizer

from overlap_optim.spec import AnnotationGroup, describe_optimizer, needs_closure
from overlap_optim.comm_hooks import OptimizerHookState
from overlap_optim.ddp import install_optimizer_hook
from overlap_optim.update import table_optimizer
from sharders.fallback import FallbackEmbeddingBag
from sharders.fbgemm import install_fused_kernel_hooks
from sharders.live_settings import install_settings_check
from sharders.layerwise import CrossShardTable, Geometry, LayerwiseRound, cross_shard_class, install_round
from sharders.optimizer_table import COLUMN_SPLITTING, ROW_SPLITTING, KernelChoice, choose_kernel, semantics_of
from sharders.table_state import ShardedTables

__all__ = ["EmbeddingBagCollectionSharder", "TableDecision"]

# TorchRec groups tables into kernels by their fused params, "_batch_key"
# included, and drops that entry before building a kernel: it keeps each
# annotation group (a param group, with its own LR schedule) in its own kernels.
_GROUP_KEY = "_batch_key"


@dataclasses.dataclass(frozen=True)
class TableDecision:
    """Where one table's update runs, and why. ``describe()`` prints these."""

    table: str
    sharding_type: str
    group: AnnotationGroup | None  # None: no annotation, the gradient goes back to the user
    choice: KernelChoice
    dense_requested: bool = False  # named in dense_tables
    cross_shard: bool = False  # split, layer-wise: statistics across shards (sharders.layerwise)

    @property
    def semantics(self) -> str:
        """"lazy": only the rows a batch touched change; "dense": every row steps, on a zero
        gradient where untouched (the whole-table optimizer); "user": not ours to step."""
        return "user" if self.group is None else semantics_of(self.group.spec, self.kernel, self.dense_requested)

    @property
    def kernel(self) -> str:
        if self.group is None:
            return "user"
        if self.sharding_type == ShardingType.DATA_PARALLEL.value:
            return "data_parallel_hook"
        return "fused" if self.choice.fused else "fallback"


class EmbeddingBagCollectionSharder(_TorchRecSharder):
    """Drop-in for TorchRec's ``EmbeddingBagCollectionSharder``; see the module doc.

    Example:
        >>> sharder = EmbeddingBagCollectionSharder()
        >>> plan = EmbeddingShardingPlanner(topology=topology).collective_plan(model, [sharder], pg)
        >>> model = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
    """

    def __init__(
        self,
        fused_params: dict[str, Any] | None = None,
        *,
        fallback_tables: Iterable[str] = (),
        dense_tables: Iterable[str] = (),
        **kwargs: Any,
    ) -> None:
        """``fallback_tables``: tables to run in the fallback even where FBGEMM could fuse them.
        ``dense_tables``: tables to run with dense semantics (in the fallback; see the module doc)."""
        for option, names in (("fallback_tables", fallback_tables), ("dense_tables", dense_tables)):
            if isinstance(names, str):
                raise TypeError(f"{option} takes table names, got the string {names!r}")
        self.fallback_tables = frozenset(fallback_tables)
        self.dense_tables = frozenset(dense_tables)
        optimizer_keys = sorted(set(fused_params or {}) & {"optimizer", "learning_rate", "eps", "weight_decay"})
        if optimizer_keys:
            raise ValueError(
                f"fused_params {optimizer_keys} set an optimizer for every table; annotate the tables "
                "with overlap_optim.apply_optimizer_in_backward instead"
            )
        super().__init__(fused_params=fused_params, **kwargs)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = list(super().sharding_types(compute_device_type))
        return types + [t for t in ROW_SPLITTING if t not in types]

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingBagCollection:
        device = device or torch.device("cpu")
        torch_made: dict[str, AnnotationGroup] = {}
        decisions = {
            config.name: _decide(
                module, config.name, params[config.name], device, torch_made, self.fallback_tables, self.dense_tables
            )
            for config in module.embedding_bag_configs()
        }
        for option, names in (("fallback_tables", self.fallback_tables), ("dense_tables", self.dense_tables)):
            unknown = sorted(names - set(decisions))
            if unknown:
                raise ValueError(f"{option} names tables this module does not have: {unknown}")
        unannotated = sorted(n for n in self.dense_tables & set(decisions) if decisions[n].group is None)
        if unannotated:
            raise ValueError(
                f"dense_tables names tables with no in-backward optimizer: {unannotated}; their gradient "
                "goes to your own optimizer, which decides their semantics"
            )
        params = {name: _with_kernel(sharding, decisions.get(name)) for name, sharding in params.items()}
        with _translated_annotations(module, decisions):
            sharded = super().shard(module, params, env, device, module_fqn)
        shapes = {c.name: (c.num_embeddings, c.embedding_dim) for c in module.embedding_bag_configs()}
        _install_fallback_kernels(sharded, decisions, env, shapes)
        _mark_updated_in_backward(sharded, decisions)
        fused = [k for lookup, k in kernels_of(sharded) if _is_fused(lookup, k)]
        install_fused_kernel_hooks(fused, {n: d.group for n, d in decisions.items()}, device.type)
        install_settings_check(sharded, decisions, device.type)
        for name, decision in decisions.items():  # the sharded module holds the tables now
            if decision.group is None:
                continue
            unsharded = module.embedding_bags[name].weight
            params = decision.group.param_group["params"]
            params[:] = [p for p in params if p is not unsharded]
        _install_data_parallel_hooks(sharded, decisions, env)
        sharded._overlap_decisions = decisions
        sharded.overlap_tables = ShardedTables(sharded, decisions, env.process_group)
        return sharded


def annotation_of(
    weight: torch.Tensor, table: str, torch_made: dict[str, AnnotationGroup] | None = None
) -> AnnotationGroup | None:
    """The table's annotation, also when torch's own ``_apply_optimizer_in_backward`` made it;
    None for a table with no annotation.

    Tables that torch's function annotated with equal settings share one group
    per ``torch_made`` dict (that function does not record which call made what).
    """
    group = getattr(weight, "_overlap_group", None)
    if group is not None:
        return group
    classes = getattr(weight, "_optimizer_classes", None)
    if not classes or classes[0] is None:
        return None
    cls, kwargs = classes[0], dict(weight._optimizer_kwargs[0])
    made = {} if torch_made is None else torch_made
    label = _setting_label(cls, kwargs)
    if label not in made:
        if needs_closure(cls):
            raise ValueError(f"table {table!r}: {cls.__name__} needs a closure in step() and cannot run in backward")
        try:
            made[label] = AnnotationGroup(describe_optimizer(cls, kwargs))
        except (TypeError, ValueError, NotImplementedError) as err:  # name the table torch annotated
            raise type(err)(f"table {table!r}: {err}") from None
    return made[label]


def _decide(
    module: nn.Module,
    table: str,
    sharding: ParameterSharding,
    device: torch.device,
    torch_made: dict[str, AnnotationGroup],
    pinned: frozenset[str] = frozenset(),
    dense: frozenset[str] = frozenset(),
) -> TableDecision:
    group = annotation_of(module.embedding_bags[table].weight, table, torch_made)
    if group is None:  # TorchRec's dense kernel: the gradient is handed back on the weight
        return TableDecision(table, sharding.sharding_type, None, KernelChoice(False, reason="no annotation"))
    choice = choose_kernel(
        group.optimizer_class, group.optimizer_kwargs, device.type, table=table, settings=group.hyperparameters()
    )
    if choice.fused and table in dense:
        choice = KernelChoice(False, reason="dense semantics requested (dense_tables)")
    elif choice.fused and table in pinned:
        choice = KernelChoice(False, reason="pinned to the fallback (fallback_tables)")
    elif choice.fused and sharding.compute_kernel == EmbeddingComputeKernel.DENSE.value:
        choice = KernelChoice(False, reason="the plan gives it compute kernel 'dense'")
    cross_shard = _check_separable(table, group, sharding)
    return TableDecision(table, sharding.sharding_type, group, choice, dense_requested=table in dense,
                         cross_shard=cross_shard)


def _check_separable(table: str, group: AnnotationGroup, sharding: ParameterSharding) -> bool:
    """Refuse a table split along an axis its optimizer cannot be split by (its update reads
    the whole matrix: Adafactor's factored moments, Muon's orthogonalisation, a per-row
    accumulator split into column shards), unless :mod:`sharders.layerwise` has a cross-shard
    form of it: then True, the table's statistics travel in the module's round."""
    shards = sharding.sharding_spec.shards if sharding.sharding_spec is not None else []
    spec = group.spec
    for axis, what, separable in ((0, "row", spec.row_separable), (1, "column", spec.column_separable)):
        if separable or len({s.shard_offsets[axis] for s in shards}) <= 1:
            continue
        if cross_shard_class(spec.optimizer_class) is not None:
            return True
        works = ["table_wise", "data_parallel"]
        works += list(ROW_SPLITTING) if spec.row_separable else []
        works += list(COLUMN_SPLITTING) if spec.column_separable else []
        raise ValueError(
            f"table {table!r}: {spec.name}'s update is not separable by {what}s (stepping {what} pieces "
            f"apart differs from stepping the whole table), and {sharding.sharding_type} sharding splits "
            f"this table into {what} shards; use {', '.join(works)} for this table"
        )
    return False


def _with_kernel(sharding: ParameterSharding, decision: TableDecision | None) -> ParameterSharding:
    if decision is None or sharding.sharding_type == ShardingType.DATA_PARALLEL.value:
        return sharding
    fused = decision.group is not None and decision.choice.fused
    kernel = EmbeddingComputeKernel.FUSED if fused else EmbeddingComputeKernel.DENSE
    return dataclasses.replace(sharding, compute_kernel=kernel.value)


def _setting_label(cls: type, kwargs: dict[str, Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}{sorted(kwargs.items())}"


@contextlib.contextmanager
def _translated_annotations(module: nn.Module, decisions: dict[str, TableDecision]) -> Iterator[None]:
    """While TorchRec shards, each table's annotation reads as its translated fused params.

    TorchRec maps ``_optimizer_classes[0]`` itself and passes every other kwarg
    to FBGEMM untranslated; with the class hidden and the kwargs replaced, it
    passes exactly what :func:`choose_kernel` produced.
    """
    saved = {}
    tokens: dict[Any, int] = {}  # numbered by first table: the same on every rank
    for name, decision in decisions.items():
        weight = module.embedding_bags[name].weight
        saved[name] = {a: weight.__dict__[a] for a in ("_optimizer_classes", "_optimizer_kwargs") if a in weight.__dict__}
        fused = decision.choice.fused and decision.kernel == "fused"
        weight._optimizer_classes = [None]
        group_key = {_GROUP_KEY: f"overlap_optim:{tokens.setdefault(_kernel_group(decision), len(tokens))}"}
        weight._optimizer_kwargs = [{**decision.choice.fbgemm_kwargs, **group_key} if fused else group_key]
    try:
        yield
    finally:
        for name, attrs in saved.items():
            weight = module.embedding_bags[name].weight
            for attr in ("_optimizer_classes", "_optimizer_kwargs"):
                weight.__dict__.pop(attr, None)
            weight.__dict__.update(attrs)


def _kernel_group(decision: TableDecision) -> Any:
    """Tables with equal values may share a kernel. A fused TBE has one learning rate: one per
    annotation group. Fallback tables whose settings differ only in floats form one virtual
    group (one lookup, one multi-tensor update with per-table settings; see
    :mod:`overlap_optim.virtual_groups`), so they share a kernel."""
    if decision.group is None:
        return "user"
    if decision.choice.fused:
        return ("fused", id(decision.group))
    return ("fallback", decision.group.spec.share_key)


def _is_fused(lookup: nn.Module, kernel: nn.Module) -> bool:
    return not isinstance(lookup, DistributedDataParallel) and kernel.config.compute_kernel == EmbeddingComputeKernel.FUSED


def kernels_of(sharded: ShardedEmbeddingBagCollection) -> Iterator[tuple[nn.Module, nn.Module]]:
    """(lookup, kernel) for every kernel of every lookup of a sharded EBC."""
    for lookup in sharded._lookups:
        inner = lookup.module if isinstance(lookup, DistributedDataParallel) else lookup
        for kernel in getattr(inner, "_emb_modules", []):
            yield lookup, kernel


def _install_fallback_kernels(
    sharded: ShardedEmbeddingBagCollection,
    decisions: dict[str, TableDecision],
    env: ShardingEnv,
    shapes: dict[str, tuple[int, int]],
) -> None:
    cross = [  # the same order and sizes on every rank
        (name, cross_shard_class(d.group.spec.optimizer_class).slot_size(_geometry(d, shapes[name])))
        for name, d in decisions.items()
        if d.cross_shard
    ]
    round_ = LayerwiseRound(cross, env.process_group) if cross else None
    for lookup, kernel in kernels_of(sharded):
        if isinstance(lookup, DistributedDataParallel) or kernel.config.compute_kernel != EmbeddingComputeKernel.DENSE:
            continue
        tables = {t.name: decisions[t.name] for t in kernel.config.embedding_tables}
        if any(d.group is None for d in tables.values()):  # unannotated tables (a kernel of their own): the user's
            assert all(d.group is None for d in tables.values()), tables
            continue
        makers = {t.name: _table_maker(t, decisions[t.name], round_) for t in kernel.config.embedding_tables}
        optimizer = FallbackEmbeddingBag.adopt(kernel, makers).fallback_optimizer
        # TorchRec combined its kernels' fused optimizers before we saw them; add ours,
        # keyed as TorchRec keys the fused ones, so DMP's fused_optimizer covers them too.
        optimizer.params = {f"embedding_bags.{k}": v for k, v in optimizer.params.items()}
        sharded._optim._optims.append(("", optimizer))
    if round_ is not None:
        install_round([k for lookup, k in kernels_of(sharded) if not isinstance(lookup, DistributedDataParallel)], round_)
        sharded.overlap_round = round_


def _table_maker(table: Any, decision: TableDecision, round_: LayerwiseRound | None):
    """``weight -> its table optimizer``, for one table shard of a fallback kernel."""
    if not decision.cross_shard:
        return lambda weight: table_optimizer(weight, decision.group, decision.table, decision.semantics)
    implementation = cross_shard_class(decision.group.spec.optimizer_class)
    geometry = _geometry(decision, (table.num_embeddings, table.embedding_dim), table.local_metadata.shard_offsets)
    return lambda weight: implementation(weight, decision.group, decision.table, geometry, round_)


def _geometry(decision: TableDecision, shape: tuple[int, int], offsets=(0, 0)) -> Geometry:
    return Geometry(tuple(shape), tuple(offsets), 0 if decision.sharding_type in ROW_SPLITTING else 1)


def _mark_updated_in_backward(sharded: ShardedEmbeddingBagCollection, decisions: dict[str, TableDecision]) -> None:
    """Mark each fallback table's weight as TorchRec marks a fused one, the empty placeholder
    of a table held on other ranks included, so that TorchRec's ``in_backward_optimizer_filter``
    keeps it from the user's optimizer: ``CombinedOptimizer([model.fused_optimizer, user])``
    then sees each key once."""
    for name, decision in decisions.items():
        weight = sharded.embedding_bags[name].weight
        if decision.kernel == "fallback" and not hasattr(weight, "_in_backward_optimizers"):
            weight._in_backward_optimizers = [EmptyFusedOptimizer()]


def _install_data_parallel_hooks(
    sharded: ShardedEmbeddingBagCollection, decisions: dict[str, TableDecision], env: ShardingEnv
) -> None:
    """Step each data-parallel table's optimizer on its all-reduced gradient."""
    for lookup in sharded._lookups:
        if not isinstance(lookup, DistributedDataParallel):
            continue
        targets: dict[int, list] = {}
        managed = []
        for kernel in lookup.module._emb_modules:
            if decisions[kernel.config.embedding_tables[0].name].group is None:
                continue  # unannotated tables keep their averaged gradient for the user
            flat = kernel.emb_module.weights
            managed.append(flat)
            for table, view in _table_views(kernel):
                weight = sharded.embedding_bags[table].weight
                _attach(weight, decisions[table].group)
                targets.setdefault(id(flat), []).append((weight, view))
        if targets:
            install_optimizer_hook(lookup, OptimizerHookState(env.process_group, targets, managed))


def _table_views(kernel: nn.Module) -> Iterator[tuple[str, Any]]:
    emb = kernel.emb_module
    for t_idx, (rows, dim) in enumerate(emb.embedding_specs):
        start = emb.weights_physical_offsets[t_idx]
        name = kernel.config.embedding_tables[t_idx].name
        yield name, (lambda g, s=start, r=rows, d=dim: g[s : s + r * d].view(r, d))


def _attach(weight: torch.Tensor, group: AnnotationGroup) -> None:
    """Give a sharded table's parameter a live optimizer that a hook steps (no grad hook)."""
    weight._optimizer_classes = [group.optimizer_class]
    weight._optimizer_kwargs = [dict(group.optimizer_kwargs)]
    weight._overlap_group = group
    weight._in_backward_optimizers = [group.spec.make([weight])]
    group.param_group["params"].append(weight)
