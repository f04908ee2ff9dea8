"""Managed-collision collections are refused, by class, before anything is sharded.

``ManagedCollisionEmbeddingCollection`` and ``ManagedCollisionEmbeddingBagCollection``
(sharded or not) remap each id through a module whose state TorchRec updates on
its own, outside the optimizer and per rank: an evicted slot's new id inherits the old
id's optimizer state, and a row shard's remapping differs from the unsharded module's.
One process of ``torch.optim`` is not their reference, so they cannot keep the promise yet.

They are refused wherever one meets our code first: our planner (:func:`refuse_managed_collision`
of the model), our sharders (the whole model DMP shards, before its first module changes; or, when
TorchRec's managed-collision sharder hands our sharder its inner collection, that collection), and
our data-parallel wrappers (after DMP has sharded the rest with other sharders).
"""

from __future__ import annotations

from torch import nn
from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

from sharders import _private

__all__ = ["refuse_managed_collision", "refuse_managed_collision_sharding"]

# Managed-collision collections (EC and EBC), unsharded and sharded.
_MANAGED_COLLISION = (BaseManagedCollisionEmbeddingCollection, BaseShardedManagedCollisionEmbeddingCollection)
_INSTEAD = (
    "managed-collision collections are not supported by overlap-optim's sharders yet (their id remapping keeps "
    "state outside the optimizer, per rank, so training them is not exactly torch.optim). Remap ids before the "
    "model and use a plain EmbeddingCollection or EmbeddingBagCollection"
)


def refuse_managed_collision(model: nn.Module) -> None:
    """Raise ``NotImplementedError`` naming the first managed-collision collection in ``model``
    (sharded or not), by class and path; see the module doc."""
    for path, module in model.named_modules():
        if isinstance(module, _MANAGED_COLLISION):
            raise NotImplementedError(f"{type(module).__name__} at {path or 'the root'!r}: {_INSTEAD}")


def refuse_managed_collision_sharding(module: nn.Module, whole: nn.Module | None, path: str) -> None:
    """Before our sharder shards ``module`` (at ``path``): refuse a managed-collision collection in
    ``whole``, the model being sharded (None when no ``DistributedModelParallel`` is sharding), and
    ``module`` itself when TorchRec's managed-collision sharder handed it to us."""
    if whole is not None:
        refuse_managed_collision(whole)
    if _private.sharding_inside_managed_collision():
        where = f" at {path!r}" if path else ""
        raise NotImplementedError(
            f"{type(module).__name__}{where}, the collection inside a managed-collision collection, handed to "
            f"overlap-optim's sharder by TorchRec's managed-collision sharder: {_INSTEAD}"
        )
