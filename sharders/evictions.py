"""Managed-collision collections (ZCH): what an evicted slot becomes, and which collections are refused.

TorchRec's managed-collision module remaps each id into a slot of the table and, when it evicts a
slot for a new id, names it. Under our managed-collision sharders (:mod:`sharders.managed_collision`),
before the batch is looked up:

- the evicted slot's weight is re-initialised with the table's ``init_fn``, as TorchRec does it;
- its optimizer state becomes a fresh row's, for every kind that keeps per-row state: each
  per-row entry takes the value one element holds before its first update
  (:attr:`overlap_optim.spec.StateEntry.fresh`: zero for Adam's moments, ``initial_accumulator_value``
  for Adagrad's ``sum``). Per-table entries (``step``) are one per parameter in ``torch.optim``
  and go on counting. Stock TorchRec resets only row-wise Adagrad's fused momentum.

Refused by name, before any module is sharded (:func:`check_evictable`,
:func:`refuse_managed_collision`, :func:`refuse_weighted`): a weighted collection (TorchRec's sharded
managed-collision collection drops the per-sample weights), a table whose optimizer keeps state that is not per row
(a column factor: Adafactor, CAME), an unannotated table (your optimizer holds its state), a
managed-collision collection given to any other sharder (TorchRec's own, or our collection sharder
on its inner collection, where each rank would remap its own batch), and one under a wrapper that
DMP did not shard with ours.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torchrec.distributed.mc_embedding import ShardedManagedCollisionEmbeddingCollection
from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection
from torchrec.distributed.mc_embeddingbag import ShardedManagedCollisionEmbeddingBagCollection
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

from overlap_optim import plans
from overlap_optim.clipping import clipping_of
from overlap_optim.record import module_record
from sharders import _private
from sharders.kernels import KernelKind, TableKernel

__all__ = [
    "EvictingBagCollection", "EvictingEmbeddingCollection", "EvictingSharder", "check_evictable", "is_ours", "refuse_managed_collision",
    "refuse_managed_collision_sharding", "refuse_weighted",
]

_MANAGED_COLLISION = (BaseManagedCollisionEmbeddingCollection, BaseShardedManagedCollisionEmbeddingCollection)
_INSTEAD = (
    "shard managed-collision collections with sharders.ManagedCollisionEmbeddingBagCollectionSharder (or "
    "ManagedCollisionEmbeddingCollectionSharder), passed to DistributedModelParallel and the planner: any other "
    "sharder leaves an evicted slot's optimizer state to its new id, or remaps on each rank apart"
)


class _ExactEviction:
    """The eviction of TorchRec's sharded managed-collision collection, with each evicted slot's
    optimizer state made a fresh row's (see the module doc); and the row shards its remapping was
    built for, kept: each shard's managed-collision module remaps ids into its own slots, and a
    checkpoint of other shards, merged by TorchRec, would not remap as it did."""

    model_clips: tuple = ()  # the clipping sets of the model it was sharded in (watch_model_clips)

    def watch_model_clips(self, root: nn.Module) -> None:
        """Check, before every remapping (which evicts, changing weights), the members of each
        clipping set of the model ``root``: a set refused at the end of backward would otherwise
        be refused after an eviction changed the model."""
        self.model_clips = tuple({id(c): c for p in root.parameters() if (c := clipping_of(p)) is not None}.values())

    def keep_layout(self) -> None:
        """Remember the output segments of each table's remapping as sharded (copies); and, after every
        load, count iterations again from the loaded count, as a fresh module does (TorchRec's keeps
        counting from where it was, so a state dict loaded back in place would not remap as the
        uninterrupted run does)."""
        self.layout = {key: value.detach().clone() for key, value in _private.remapping_layouts(self).items()}
        self.register_load_state_dict_post_hook(lambda module, incompatible: _private.reread_remapping_count(module))

    def refuse_other_layout(self, state: Any, prefix: str = "", start: str = "") -> None:
        """Raise ValueError, naming the table, if ``state`` (keys ``prefix + start + <key below this
        module>``) holds a remapping split into other row shards than this one."""
        for key, value in self.layout.items():
            saved = state.get(prefix + start + key)
            if saved is not None and not torch.equal(torch.as_tensor(saved), value):
                self._refuse(key, torch.as_tensor(saved))

    def compute(self, ctx: Any, dist_input: Any) -> Any:
        """TorchRec's (remap, evict, look up), after the checks the lookup would run first and the
        model's clipping sets' member checks (a refusal leaves the remapping and the evicted slots as
        they were), and after checking that no load
        (``dcp.load`` writes buffers in place) replaced the remapping's row shards."""
        before_lookup = plans.plan_of(_private.mc_collection_of(self)).before_lookup
        if before_lookup is not None:
            before_lookup()
        for clip in self.model_clips:
            clip.check_members()
        for key, value in _private.remapping_layouts(self).items():
            if not torch.equal(value, self.layout[key]):
                self._refuse(key, value)
        return super().compute(ctx, dist_input)

    def _refuse(self, key: str, saved: torch.Tensor) -> None:
        def starts(t: torch.Tensor) -> list[int]:
            return [int(x) for x in t.tolist() if x >= 0][:-1]
        raise ValueError(
            f"managed-collision table {key.rsplit('.', 2)[-2]!r}: the state dict was saved with its rows in the shards "
            f"starting at {starts(saved)}, this model splits them at {starts(self.layout[key])}: each shard remaps ids "
            "into its own slots, so the remapping would not go on as it did. Load it on the world size and plan it "
            "was saved with"
        )

    def _evict(self, evictions_per_table: dict[str, torch.Tensor | None]) -> None:
        inner = _private.mc_collection_of(self)
        plan = plans.plan_of(inner)
        for table, rows in evictions_per_table.items():
            if rows is None or rows.numel() == 0:
                continue
            rows = rows.long()
            with torch.no_grad():
                weight = getattr(inner, plan.state.tables_attr).get_parameter(f"{table}.weight")
                weight[rows] = _private.table_init_fn(inner, table)(weight[rows])  # TorchRec's rule
                plan.state.reset_rows(table, rows)


class EvictingBagCollection(_ExactEviction, ShardedManagedCollisionEmbeddingBagCollection):
    """TorchRec's sharded managed-collision EBC, with the exact eviction; and its mean-pooling divisor,
    which it makes in its own input dist (not its inner collection's), rounded as our EBC sharder rounds
    it (:func:`sharders._private.divide_only_row_split_means`: TorchRec adds 1e-6 to every bag length,
    which ill-conditioned updates such as LAMB's amplify). Weighted ones are refused."""

    def input_dist(self, ctx: Any, features: Any) -> Any:
        out = super().input_dist(ctx, features)
        _private.round_mean_divisor(ctx)
        return out


class EvictingEmbeddingCollection(_ExactEviction, ShardedManagedCollisionEmbeddingCollection):
    """TorchRec's sharded managed-collision EC, with the exact eviction."""


class EvictingSharder:
    """What both managed-collision sharders (:mod:`sharders.managed_collision`) add to TorchRec's: our
    collection sharder inside, its compute kernels offered, the tables checked before sharding, and
    the sharded class with the exact eviction."""

    sharded_class: type
    collection_sharder: Any  # our EBC or EC sharder, which runs the tables
    remapping_sharder: Any  # TorchRec's ManagedCollisionCollectionSharder

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        """The compute kernels our collection sharder runs (a fallback table asks for "dense")."""
        return self.collection_sharder.compute_kernels(sharding_type, compute_device_type)

    def shard(
        self, module: nn.Module, params: dict[str, ParameterSharding], env: ShardingEnv,
        device: torch.device | None = None, module_fqn: str | None = None,
    ) -> nn.Module:
        device = device or torch.device("cpu")
        if _private.model_being_sharded() is None:  # else check_model checked it before the first module
            refuse_weighted(module, module_fqn or "")
            check_evictable(self.collection_sharder._table_kernels(
                _private.mc_collection_of(module), params, device.type, module_fqn or ""), module_fqn or "")
        self.collection_sharder.handed_path = module_fqn or ""  # qualifies its table names as check_model did
        try:
            sharded = self.sharded_class(module, params, self.collection_sharder, self.remapping_sharder, env=env,
                                         device=device)
        finally:
            self.collection_sharder.handed_path = None
        sharded.keep_layout()
        whole = _private.model_being_sharded()
        if whole is not None:
            sharded.watch_model_clips(whole.root)
        _install_layout_check(sharded, whole.root if whole is not None else None, module_fqn or "")
        return sharded


def check_evictable(kernels: dict[str, TableKernel], path: str) -> None:
    """Raise ``NotImplementedError`` naming the table of a managed-collision collection (at ``path``)
    whose evicted rows could not be given a fresh row's state (see the module doc)."""
    where = f" of the managed-collision collection at {path!r}" if path else " of a managed-collision collection"
    for name, kernel in kernels.items():
        group = kernel.group
        if group is None:
            if kernel.kind is KernelKind.USER:
                raise NotImplementedError(
                    f"table {name!r}{where} has no in-backward optimizer: your own optimizer keeps its state, which "
                    "an eviction cannot reset. Annotate it (overlap_optim.apply_optimizer_in_backward)"
                )
            continue
        spec = group.spec
        kept = sorted(n for n, entry in (spec.state or {}).items()
                      if entry.layout != "scalar" and not entry.row_sliceable)
        if kept:
            raise NotImplementedError(
                f"table {name!r}{where}: {spec.name} keeps state that is not per row ({kept}), so an evicted "
                "slot has no fresh state of its own. Annotate it with an optimizer whose state is per row or per "
                "element (Adagrad, Adam, SGD...)"
            )


def is_ours(sharder: Any) -> bool:
    """Whether ``sharder`` is one of our managed-collision sharders."""
    return isinstance(sharder, EvictingSharder)


def refuse_managed_collision(model: nn.Module, sharders_by_type: dict[type, Any] | None = None) -> None:
    """Raise ``NotImplementedError`` naming the first managed-collision collection in ``model`` that
    is not ours to shard: sharded by another sharder, or, unsharded, with ``sharders_by_type``
    (module type -> sharder) naming none of ours for it (None: every unsharded one is refused)."""
    for path, module in model.named_modules():
        if isinstance(module, (EvictingBagCollection, EvictingEmbeddingCollection)):
            continue
        if isinstance(module, BaseManagedCollisionEmbeddingCollection) and sharders_by_type is not None \
                and is_ours(sharders_by_type.get(type(module))):
            refuse_weighted(module, path)
            continue
        if isinstance(module, _MANAGED_COLLISION):
            raise NotImplementedError(f"{type(module).__name__} at {path or 'the root'!r}: {_INSTEAD}")


def refuse_weighted(module: nn.Module, path: str) -> None:
    """Raise ``NotImplementedError`` naming the managed-collision collection at ``path`` if its
    collection takes per-sample weights: TorchRec's sharded managed-collision collection looks its
    ids up as if every weight were 1."""
    inner = _private.mc_collection_of(module)
    if getattr(inner, "is_weighted", lambda: False)():
        raise NotImplementedError(
            f"{type(module).__name__} at {path or 'the root'!r} holds a weighted {type(inner).__name__} "
            "(is_weighted=True): TorchRec's sharded managed-collision collection drops the per-sample weights "
            "(every id weighs 1). Weigh the pooled embeddings in the model instead, or use an unweighted collection"
        )


def refuse_managed_collision_sharding(module: nn.Module, whole: Any, path: str) -> None:
    """Before our collection sharder shards ``module`` (at ``path``): refuse a managed-collision
    collection of ``whole`` (the model ``DistributedModelParallel`` is sharding, None without one)
    that our managed-collision sharders do not shard, and ``module`` itself when a sharded
    managed-collision collection other than ours is being built around it."""
    if whole is not None:
        refuse_managed_collision(whole.root, whole.sharders)
    around = _private.managed_collision_being_built()
    if around is not None and not isinstance(around, (EvictingBagCollection, EvictingEmbeddingCollection)):
        where = f" at {path!r}" if path else ""
        raise NotImplementedError(
            f"{type(module).__name__}{where}, the collection inside a managed-collision collection, handed to "
            f"overlap-optim's collection sharder while TorchRec builds its {type(around).__name__}: {_INSTEAD}"
        )


def _install_layout_check(sharded: nn.Module, root: nn.Module | None, path: str) -> None:
    """Make loads into ``sharded`` (at ``path`` in ``root``, the model DMP shards; None: none) refuse
    a checkpoint whose tables were split into other row shards (:meth:`_ExactEviction.refuse_other_layout`):
    a ``load_state_dict`` pre-hook (on the root under DMP: nothing of the model loaded first), and a
    check :func:`overlap_optim.checkpoint.load` runs before it loads anything."""
    owner, start = (root, f"{path}.") if root is not None and path else (sharded, "")
    check = functools.partial(sharded.refuse_other_layout, start=start)
    _private.run_first_on_load(owner, lambda module, state, prefix, *rest: check(state, prefix))
    module_record(owner).load_checks.append(check)
