"""What our two sharders share: every table of a collection gets exactly its torch.optim update.

:class:`CollectionSharder` is mixed into TorchRec's sharder of one collection
(``EmbeddingBagCollectionSharder`` in :mod:`sharders.embeddingbag`,
``EmbeddingCollectionSharder`` in :mod:`sharders.embedding`). A collection is
told apart only by :attr:`CollectionSharder.tables_attr` (where its tables sit:
``embedding_bags`` or ``embeddings``) and :meth:`CollectionSharder.table_configs`;
the lookup's shape (pooled or not) is the kernels' business (:mod:`sharders.pooling`).
TorchRec shards; then, for every table:

- its annotation is translated by :mod:`sharders.optimizer_table` into one
  kernel kind (:mod:`sharders.kernels`): fusable settings reach FBGEMM translated
  name by name (tables with equal settings share one fused TBE), everything else
  goes to the fallback kernel (grouped by setting in the same way). Nothing
  untranslated reaches FBGEMM;
- each kind takes over TorchRec's kernels of its tables and installs what it
  needs: the data-parallel hook, the end-of-backward round, clipping, the
  ``no_step`` window.

A table whose weight has ``requires_grad=False`` is frozen (:mod:`sharders.frozen`).
A fusable table can be pinned to the fallback, by name (``fallback_tables=``) or
by a plan that gives it compute kernel "dense"; any other kernel in the plan is
replaced by the decision above. ``dense_tables=`` names tables that step every
row of their shard on every batch (dense semantics, in the fallback).

A table with no annotation gets TorchRec's dense kernel (or, data-parallel, plain
DDP): its gradient is handed back on the sharded weight's ``.grad`` for the
user's own optimizer (see ``overlap_optim.unoptimized_parameters``); stock
TorchRec would silently train it with FBGEMM's default SGD.

Refused at sharding time, with the table's name: an optimizer that needs a
closure, and a table split into row (column) shards whose optimizer the optimizer
model (:mod:`overlap_optim.spec`) finds not separable by rows (columns) and that
has no cross-shard form.

``load_state_dict`` refuses table weights of another dtype than the tables hold, by name
(:mod:`sharders.weight_dtypes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding, ShardedModule, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import data_type_to_dtype

from overlap_optim import plans
from overlap_optim.accumulation import module_accumulating
from overlap_optim.annotation import carry_over
from overlap_optim.clipping import clipping_of, mark_taken
from overlap_optim.record import group_of
from overlap_optim.round import EndOfBackwardRound, arm_in_backward
from overlap_optim.spec import AnnotationGroup
from sharders import _private
from sharders._private import kernels_of
from sharders.data_parallel import DataParallelWrapper, FullyShardWrapper
from sharders.kernels import ROW_SPLITTING, BuildContext, TableKernel
from sharders.kinds import Kind, check_kinds
from sharders.live_settings import install_settings_check
from sharders.evictions import check_evictable, is_ours, refuse_managed_collision_sharding
from sharders.optimizer_table import decide
from sharders.plan import ShardedModulePlan
from sharders.table_state import ShardedTables
from sharders.two_dimensional import refuse_two_dimensional
from sharders.weight_dtypes import install_dtype_check

__all__ = ["CollectionSharder", "check_model", "SAFE_FUSED_PARAMS"]

# TorchRec fused_params that change where a table lives or how it is fetched, never the numbers:
# the only ones our sharders pass on. Any other key (gradient_clipping and max_gradient, which clamp
# the pooled output gradient; weight_decay_mode and its COWCLIP or counter settings; momentum,
# beta1, beta2, eta; output_dtype; cache_precision) is refused where the sharder is made.
SAFE_FUSED_PARAMS = frozenset({
    "cache_load_factor", "cache_algorithm", "cache_reserved_memory", "prefetch_pipeline", "enforce_hbm",
    "bounds_check_mode", "use_one_tbe_per_table",
    "stochastic_rounding",  # rounds only FBGEMM's own FP16 updates, which never step a table (ours do on CPU)
})


class CollectionSharder:
    """Mixed into a TorchRec sharder (listed before it); see the module doc."""

    tables_attr: ClassVar[str]  # the collection's ModuleDict of tables, sharded or not
    # the path that qualifies table names (fallback_tables=, dense_tables=) while TorchRec's managed-collision
    # collection, sharded at that path, hands over its inner collection with none (sharders.evictions)
    handed_path: str | None = None

    def __init__(
        self,
        fused_params: dict[str, Any] | None = None,
        *,
        fallback_tables: Iterable[str] = (),
        dense_tables: Iterable[str] = (),
        variable_batch: bool = False,
        kinds: Iterable[Kind] = (),
        **kwargs: Any,
    ) -> None:
        """
        Args:
            fused_params: TorchRec's, without optimizer settings (annotate the tables instead).
            fallback_tables: tables to run in the fallback even where FBGEMM could fuse them.
            dense_tables: tables to run with dense semantics (in the fallback; see the module doc).
                Both take table names, or names qualified by the collection's path (``"ebc_a.t0"``)
                where two collections of the model have a table of that name.
            variable_batch: the module will take batches with a variable batch size per feature
                (VBE): every annotated table runs in the fallback, exactly on them whatever its
                optimizer (TorchRec's VBE merging takes one kind of kernel per lookup), and a table
                that no kernel runs so (data-parallel, frozen, unannotated) is refused at sharding.
                Without it, fused SGD and row-wise Adagrad take VBE batches in FBGEMM, and a VBE batch
                that reaches a table that cannot is refused at its first lookup.
            kinds: table kinds of your own (:class:`sharders.kinds.Kind` lines: a
                :class:`~sharders.kernels.TableKernel` subclass, when it runs a table, its install
                order), tried before the built-in ones (:data:`sharders.kinds.KINDS`).
            **kwargs: TorchRec's other arguments.

        Raises:
            TypeError: a table list given as one string; a ``kinds`` line that is not a ``Kind``.
            ValueError: a kind of ``kinds`` named as another kind is.
            ValueError: ``fused_params`` that set an optimizer.
        """
        for option, names in (("fallback_tables", fallback_tables), ("dense_tables", dense_tables)):
            if isinstance(names, str):
                raise TypeError(f"{option} takes table names, got the string {names!r}")
        self.fallback_tables = frozenset(fallback_tables)
        self.dense_tables = frozenset(dense_tables)
        if not isinstance(variable_batch, bool):
            raise TypeError(f"variable_batch takes True or False, got {variable_batch!r}")
        self.variable_batch = variable_batch
        self.kinds = check_kinds(kinds)
        optimizer_keys = sorted(set(fused_params or {}) & {"optimizer", "learning_rate", "eps", "weight_decay"})
        if optimizer_keys:
            raise ValueError(
                f"fused_params {optimizer_keys} set an optimizer for every table; annotate the tables "
                "with overlap_optim.apply_optimizer_in_backward instead"
            )
        changing = sorted(set(fused_params or {}) - SAFE_FUSED_PARAMS)
        if changing:
            raise ValueError(
                f"fused_params {changing}: FBGEMM would change the update (or the lookup) with them, where each "
                "table steps exactly as torch.optim; clip with overlap_optim.apply_gradient_clipping, set "
                f"optimizer settings in the annotation, and keep fused_params to {sorted(SAFE_FUSED_PARAMS)}"
            )
        super().__init__(fused_params=fused_params, **kwargs)

    def table_configs(self, module: nn.Module) -> list[Any]:
        """The collection's table configs, in order."""
        raise NotImplementedError

    def configs_by_name(self, module: nn.Module) -> dict[str, Any]:
        """The collection's table configs, by table name."""
        return {c.name: c for c in self.table_configs(module)}

    def check_options(self, device_type: str) -> None:
        """Raise ``NotImplementedError`` for a TorchRec option of this sharder that cannot run on
        ``device_type``, before anything is sharded. Nothing, by default."""

    def adapt_kernels(self, sharded: nn.Module) -> None:
        """Change TorchRec's kernels that no kind took over, where the collection's lookup needs it
        (after every kind adopted its kernels). Nothing, by default."""

    def table_module(self, module: nn.Module, table: str) -> nn.Module:
        """The module that holds ``table``'s weight, in the collection or its sharded form."""
        return getattr(module, self.tables_attr)[table]

    def shard(
        self,
        module: nn.Module,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> nn.Module:
        device = device or torch.device("cpu")
        whole = _private.model_being_sharded()
        refuse_two_dimensional(env)
        module_fqn = module_fqn if module_fqn is not None else self.handed_path
        refuse_managed_collision_sharding(module, whole, module_fqn or "")
        decided: dict[tuple[int, int], dict[str, TableKernel]] = {}
        if whole is not None and not any(isinstance(m, ShardedModule) for m in whole.root.modules()):
            decided = check_model(whole, device.type)  # the first module: every refusal of every module, before any changes
        self.check_options(device.type)
        tables = decided.get((id(self), id(module))) or self._table_kernels(module, params, device.type, module_fqn or "")
        params = {name: _with_kernel(sharding, tables.get(name)) for name, sharding in params.items()}
        with self._translated_annotations(module, tables):
            sharded = super().shard(module, params, env, device, module_fqn)
        for table in tables.values():  # the sharded module holds the tables now
            weight = self.table_module(module, table.table).weight
            _leave_group(weight)
            if table.clip is not None:
                table.clip.leave(weight, table.table)
        mark_taken(sharded.parameters(), f"the {type(self).__name__}")
        context = BuildContext(
            sharded, env.process_group, device.type, EndOfBackwardRound(env.process_group), tables,
            tables_attr=self.tables_attr,
        )
        _build(context)
        self.adapt_kernels(sharded)
        before_lookup = install_settings_check(sharded, tables, env.process_group)
        state = ShardedTables(_private.sharded_weights(sharded), tables, env.process_group, self.tables_attr)
        data_parallel = tuple(m for m in _private.lookups(sharded) if isinstance(m, DistributedDataParallel))
        plans.install_plan(
            sharded, ShardedModulePlan(tables, context.round, state, data_parallel, before_lookup)
        )
        install_dtype_check(sharded, whole.root if whole is not None else None)
        return sharded

    def named_in(self, option: str, path: str, tables: Iterable[str]) -> frozenset[str]:
        """The tables of the module at ``path`` that ``option`` (``fallback_tables`` or
        ``dense_tables``) names: by table name, or qualified by the module's path
        (``"ebc_a.t0"``), for a model whose collections share table names."""
        names = getattr(self, option)
        return frozenset(t for t in tables if t in names or f"{path}.{t}" in names)

    def _table_kernels(
        self, module: nn.Module, params: dict[str, ParameterSharding], device_type: str, path: str = ""
    ) -> dict[str, TableKernel]:
        """Each table's decision (:func:`sharders.optimizer_table.decide`), as its kind's kernel object."""
        configs = self.table_configs(module)
        pinned = self.named_in("fallback_tables", path, [c.name for c in configs])
        dense = self.named_in("dense_tables", path, [c.name for c in configs])
        means = {c.name: row_split_mean(c, params[c.name].sharding_type) for c in configs}
        if _private.model_being_sharded() is None:  # else check_model carried the whole model over
            carry_over(module)
        torch_made: dict[str, AnnotationGroup] = {}
        decisions = {}
        for config in configs:
            sharding = params[config.name]
            shards = sharding.sharding_spec.shards if sharding.sharding_spec is not None else []
            decisions[config.name] = decide(
                config.name, self.table_module(module, config.name).weight, sharding.sharding_type,
                [list(s.shard_offsets) for s in shards], sharding.compute_kernel,
                (config.num_embeddings, config.embedding_dim), device_type, torch_made,
                pinned=pinned, dense=dense, shard_sizes=[list(s.shard_sizes) for s in shards],
                variable_batch=self.variable_batch, dtype=stored_dtype(config), kinds=self.kinds,
            )
        if _private.model_being_sharded() is None:  # else check_model checked the names across modules
            for option in ("fallback_tables", "dense_tables"):
                unknown = sorted(n for n in getattr(self, option) if "." not in n and n not in decisions)
                if unknown:
                    raise ValueError(f"{option} names tables the module {path or '(root)'!r} does not have: {unknown}")
                unplaced = sorted(n for n in getattr(self, option) if "." in n and n.rsplit(".", 1)[1] in decisions)
                if unplaced and not path:  # they would be silently ignored: this module's path is unknown
                    raise ValueError(
                        f"{option} names {unplaced}, qualified by a module's path, and this module was sharded "
                        "without its path: pass module_fqn to shard(), as DistributedModelParallel does, or "
                        "name the tables unqualified"
                    )
        unannotated = sorted(n for n in dense if decisions[n].group is None)
        if unannotated:
            raise ValueError(
                f"dense_tables names tables with no in-backward optimizer: {unannotated}; their gradient "
                "goes to your own optimizer, which decides their semantics"
            )
        kernels = {name: d.kind.cls(d) for name, d in decisions.items()}
        for name, kernel in kernels.items():
            kernel.row_split_mean = means[name]
        if self.variable_batch:
            refused = {n: why for n, k in kernels.items() if (why := k.variable_batch_refusal()) is not None}
            if refused:
                raise ValueError(
                    f"variable_batch=True, and the module {path or '(root)'!r} has tables that no kernel runs exactly "
                    f"on a variable batch size per feature: {refused}; annotate each with an optimizer on a "
                    "model-parallel sharding type (table_wise, row_wise, column_wise...)"
                )
        return kernels

    @contextlib.contextmanager
    def _translated_annotations(self, module: nn.Module, tables: dict[str, TableKernel]) -> Iterator[None]:
        """While TorchRec shards, each table's annotation reads as its kind's fused params.

        TorchRec maps ``_optimizer_classes[0]`` itself and passes every other kwarg
        to FBGEMM untranslated; with the class hidden and the kwargs replaced, it
        passes exactly what the table's kind asks for, and groups tables into
        kernels by their kind's :meth:`~sharders.kernels.TableKernel.batch_key`.
        """
        fused_params = {}
        tokens: dict[Any, int] = {}  # numbered by first table: the same on every rank
        for name, table in tables.items():
            batch = {_private.BATCH_KEY: f"overlap_optim:{tokens.setdefault(table.batch_key(), len(tokens))}"}
            fused_params[name] = {**table.fbgemm_kwargs(), **batch}
        with _private.annotations_read_as(lambda name: self.table_module(module, name).weight, fused_params):
            yield


def stored_dtype(config: Any) -> torch.dtype:
    """The dtype a table is stored in: its config's ``data_type`` (TorchRec's unsharded module holds
    a BF16 table's weight in FP16)."""
    return data_type_to_dtype(config.data_type)


def row_split_mean(config: Any, sharding_type: str) -> bool:
    """Whether the table of ``config`` pools by MEAN and ``sharding_type`` splits its rows."""
    pooling = getattr(config, "pooling", None)
    return pooling is not None and pooling.name == "MEAN" and sharding_type in ROW_SPLITTING


def check_model(whole: _private.ModelBeingSharded, device_type: str) -> dict[tuple[int, int], dict[str, TableKernel]]:
    """Raise, naming the module and table, for anything our sharders would refuse in any module of
    ``whole`` that is still to be sharded; also for a table option that names no table of the
    model, or a bare table name that several of its collections share. Changes nothing: it runs
    on every rank before ``DistributedModelParallel`` shards the first module. Returns the table
    kernels it decided, by ``(id(sharder), id(module))``: the first module's shard uses its own."""
    carry_over(whole.root)  # the first thing that changes: a plain to_empty dropped the meta annotations
    modules = []
    evictable = []  # managed-collision collections: their inner collection, by our collection sharder
    for path, module in whole.root.named_modules():
        sharder = whole.sharders.get(type(module))
        params = whole.plan.get_plan_for_module(path)
        if is_ours(sharder) and params:
            sharder, module = sharder.collection_sharder, _private.mc_collection_of(module)
            evictable.append(path)
        if isinstance(sharder, CollectionSharder) and params:
            modules.append((sharder, path, module, params))
    _check_meta_dense(whole, modules)
    for sharder in {id(m[0]): m[0] for m in modules}.values():  # the names first: a table's own check may use them
        held = [(path, [c.name for c in sharder.table_configs(module)]) for s, path, module, _ in modules if s is sharder]
        for option in ("fallback_tables", "dense_tables"):
            _check_named(option, getattr(sharder, option), held)
    decided = {}
    for sharder, path, module, params in modules:
        sharder.check_options(device_type)
        kernels = decided[(id(sharder), id(module))] = sharder._table_kernels(module, params, device_type, path)
        if path in evictable:
            check_evictable(kernels, path)
    return decided


def _check_meta_dense(whole: _private.ModelBeingSharded, modules: list) -> None:
    """An annotated (or clipped) meta parameter outside the sharded modules keeps its annotation
    only under our wrappers: TorchRec's ``init_parameters`` replaces it, and theirs does not carry
    it over (it would train nothing, or go unclipped)."""
    if isinstance(whole.data_parallel_wrapper, (DataParallelWrapper, FullyShardWrapper)):
        return
    sharded = {id(p) for _, _, module, _ in modules for p in module.parameters()}
    for name, param in whole.root.named_parameters():
        carries = group_of(param) is not None or clipping_of(param) is not None
        if param.is_meta and carries and id(param) not in sharded:
            raise ValueError(
                f"{name!r} is annotated (or clipped) on the meta device, and the data_parallel_wrapper "
                f"{type(whole.data_parallel_wrapper).__name__} replaces it in init_parameters without its "
                "annotation: pass data_parallel_wrapper=sharders.DataParallelWrapper() (or FullyShardWrapper), "
                "or materialize the model first (overlap_optim.materialize)"
            )


def _check_named(option: str, names: frozenset[str], held: list[tuple[str, list[str]]]) -> None:
    """Every name of ``option`` names exactly one table of the modules ``held`` ((path, tables))."""
    qualified = {f"{path}.{t}" for path, tables in held for t in tables}
    for name in sorted(names):
        owners = [path for path, tables in held if name in tables]
        if len(owners) > 1:
            raise ValueError(
                f"{option} names {name!r}, a table of each of the modules {owners}: qualify it with its module's "
                f"path, such as {owners[0] + '.' + name!r}"
            )
        if not owners and name not in qualified:
            raise ValueError(f"{option} names {name!r}, which is no table of the model; its tables are {sorted(qualified)}")


def _build(context: BuildContext) -> None:
    """Each kind takes over TorchRec's kernels of its tables, then installs what it needs."""
    for table in context.tables.values():  # the same order and sizes on every rank
        table.join_round(context.round)
    for lookup, kernel in kernels_of(context.sharded):
        if isinstance(lookup, DistributedDataParallel):
            continue
        tables = [context.tables[t.name] for t in kernel.config.embedding_tables]
        # Kinds that share a kernel (equal batch keys: the fallback's lazy, dense and cross-shard
        # tables) share one adopt, which builds each table's own optimizer.
        adopt = type(tables[0]).adopt
        assert all(type(t).adopt.__func__ is adopt.__func__ for t in tables), f"one TorchRec kernel, several kinds: {tables}"
        adopt(kernel, tables, context)
    by_kind: dict[Kind, list[TableKernel]] = {}
    for table in context.tables.values():
        by_kind.setdefault(table.decision.kind, []).append(table)
    for kind, tables in sorted(by_kind.items(), key=lambda item: item[0].install_order):
        kind.cls.install(tables, context)
    arms = [context.round.arm] if context.round.slots else []
    clips = {id(t.clip): t.clip for t in context.tables.values() if t.clip is not None and t.clip.by_norm}
    arms += [clip.arm for clip in clips.values()]  # in the tables' order: the same on every rank
    if arms:  # after install: the lookups are final (a frozen kind wraps its data-parallel one again)
        _arm_from(_private.lookups(context.sharded), [_unless(context.sharded, arm) for arm in arms])


def _arm_from(lookups: list[nn.Module], arms: list[Callable[[], None]]) -> None:
    """Every rank arms the module's round, and the clipping sets of its tables, from the backward
    of each of its lookups, one per sharding type: all take part in the same collectives, tables
    held or not. A lookup that holds no table on this rank still returns a tensor that requires
    grad (TorchRec's empty-rank placeholder), and the output all-to-all's backward reaches it;
    a data-parallel lookup's output is this rank's own."""
    for lookup in lookups:
        lookup.register_forward_hook(lambda module, args, output: arm_in_backward(output, arms))


def _unless(sharded: nn.Module, arm: Callable[[], None]) -> Callable[[], None]:
    """``arm``, except inside ``no_step``: the round runs at the window's last micro-batch."""
    return lambda: None if module_accumulating(sharded) else arm()


def _with_kernel(sharding: ParameterSharding, table: TableKernel | None) -> ParameterSharding:
    """The plan's sharding with the compute kernel the table's kind runs in
    (:meth:`~sharders.kernels.TableKernel.kernel_for` the plan's)."""
    if table is None or sharding.sharding_type == ShardingType.DATA_PARALLEL.value:
        return sharding
    kernel = table.kernel_for(sharding.compute_kernel)
    if kernel is None:
        return sharding
    return dataclasses.replace(sharding, compute_kernel=EmbeddingComputeKernel(kernel).value)


def _leave_group(weight: torch.Tensor) -> None:
    group = group_of(weight)
    if group is not None:
        params = group.param_group["params"]
        params[:] = [p for p in params if p is not weight]
