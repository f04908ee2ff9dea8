"""Managed-collision collections are refused, by class.

``ManagedCollisionEmbeddingCollection`` and ``ManagedCollisionEmbeddingBagCollection``
(sharded or not) remap each id through a module whose state TorchRec updates on
its own, outside the optimizer and per rank; one process of ``torch.optim`` is
not their reference, so they cannot keep the promise. :class:`sharders.DataParallelWrapper`
raises when DMP wraps a model that holds one.
"""

from __future__ import annotations

from torch import nn
from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

__all__ = ["refuse_managed_collision"]

# Managed-collision collections (EC and EBC), unsharded and sharded.
_MANAGED_COLLISION = (BaseManagedCollisionEmbeddingCollection, BaseShardedManagedCollisionEmbeddingCollection)


def refuse_managed_collision(model: nn.Module) -> None:
    """Raise ``NotImplementedError`` naming the first managed-collision collection in ``model``
    (sharded or not), by class and path; see the module doc."""
    for path, module in model.named_modules():
        if isinstance(module, _MANAGED_COLLISION):
            raise NotImplementedError(
                f"{type(module).__name__} at {path or 'the root'!r}: managed-collision collections are not "
                "supported by overlap-optim's sharders (their id remapping keeps state outside the optimizer, "
                "so training them is not exactly torch.optim). Remap ids before the model and use a plain "
                "EmbeddingCollection or EmbeddingBagCollection"
            )
