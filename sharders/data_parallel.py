"""``DataParallelWrapper``: TorchRec's DDP wrapping, with in-backward optimizers run from the comm hook."""

from __future__ import annotations

import torch
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from overlap_optim.ddp import register_optimizer_hook

__all__ = ["DataParallelWrapper"]


class DataParallelWrapper(DefaultDataParallelWrapper):
    """What ``DistributedModelParallel(data_parallel_wrapper=...)`` takes.

    It wraps the unsharded part of the model in DDP exactly as TorchRec's
    ``DefaultDataParallelWrapper`` does (same arguments), then installs
    :func:`overlap_optim.register_optimizer_hook`, so each annotated dense
    parameter is updated by its optimizer right after its bucket is all-reduced
    and averaged. Unannotated parameters keep their averaged gradient.

    Example:
        >>> model = DistributedModelParallel(model, plan=plan, sharders=[sharder],
        ...                                  data_parallel_wrapper=DataParallelWrapper())
    """

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        comm = self._allreduce_comm_precision or "allreduce"
        self._allreduce_comm_precision = None  # TorchRec would register its own compress hook
        try:
            super().wrap(dmp, env, device)
        finally:
            self._allreduce_comm_precision = None if comm == "allreduce" else comm
        wrapped = dmp._dmp_wrapped_module
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            register_optimizer_hook(wrapped, comm=comm)
