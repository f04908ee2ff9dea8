"""``DataParallelWrapper``: TorchRec's DDP wrapping, with in-backward optimizers run from the comm hook."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from overlap_optim.annotation import reattach_annotations, record_annotations
from overlap_optim.ddp import register_optimizer_hook
from overlap_optim.local_sgd import QSR

__all__ = ["DataParallelWrapper"]

# Where DistributedModelParallel keeps the annotations of the meta parameters it will replace.
_RECORDED = "_overlap_meta_annotations"


class DataParallelWrapper(DefaultDataParallelWrapper):
    """What ``DistributedModelParallel(data_parallel_wrapper=...)`` takes.

    It wraps the unsharded part of the model in DDP exactly as TorchRec's
    ``DefaultDataParallelWrapper`` does (same arguments), then installs
    :func:`overlap_optim.register_optimizer_hook`, so each annotated dense
    parameter is updated by its optimizer right after its bucket is all-reduced
    and averaged. Unannotated parameters keep their averaged gradient.

    A model built on the meta device keeps its annotations: DMP's
    ``init_parameters`` replaces each meta parameter with a new one, and the
    wrapper annotates the new parameter as its predecessor was (by FQN). The
    record is taken when DMP registers the model, before ``init_parameters``
    runs, by a module-registration hook that lives as long as this wrapper.

    Example:
        >>> model = DistributedModelParallel(model, plan=plan, sharders=[sharder],
        ...                                  data_parallel_wrapper=DataParallelWrapper())
    """

    def __init__(self, *args, local_sgd: QSR | None = None, **kwargs) -> None:
        """``local_sgd``: an ``overlap_optim.QSR``, local SGD for the data-parallel part (dense
        layers and data-parallel tables); sharded tables stay synchronous."""
        super().__init__(*args, **kwargs)
        self.local_sgd = local_sgd
        self._recording = _record_when_registered(self)

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        reattach_annotations(dmp.module, dmp.__dict__.pop(_RECORDED, {}))
        comm = self._allreduce_comm_precision or "allreduce"
        self._allreduce_comm_precision = None  # TorchRec would register its own compress hook
        try:
            super().wrap(dmp, env, device)
        finally:
            self._allreduce_comm_precision = None if comm == "allreduce" else comm
        wrapped = dmp._dmp_wrapped_module
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            register_optimizer_hook(wrapped, comm=comm, local_sgd=self.local_sgd)


def _record_when_registered(wrapper: DataParallelWrapper):
    """Record the annotated meta parameters of each model a DMP using ``wrapper`` takes in."""
    owner = weakref.ref(wrapper)

    def hook(parent: nn.Module, name: str, child: nn.Module) -> None:
        if (
            name == "_dmp_wrapped_module"
            and isinstance(parent, DistributedModelParallel)
            and getattr(parent, "_data_parallel_wrapper", None) is owner()
            and child is not None
        ):
            parent.__dict__[_RECORDED] = record_annotations(child, meta_only=True)

    handle = nn.modules.module.register_module_module_registration_hook(hook)
    weakref.finalize(wrapper, handle.remove)
    return handle
