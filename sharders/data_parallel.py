"""``DataParallelWrapper``: TorchRec's DDP wrapping, with in-backward optimizers run from the comm hook."""

from __future__ import annotations

import warnings

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
            state = register_optimizer_hook(wrapped, comm=comm)
            bare = [p for p in wrapped._module_parameters if p.requires_grad and id(p) not in state.targets]
            if bare:
                warnings.warn(
                    f"{len(bare)} data-parallel parameter(s) carry no in-backward optimizer: they keep their "
                    "averaged gradient for your own optimizer. If you annotated them on the meta device, "
                    "DistributedModelParallel's init_parameters replaced them (Module.to_empty) and dropped "
                    "the annotation: build the dense part on a real device, or call "
                    "overlap_optim.materialize(model.dense_part, device) before DistributedModelParallel.",
                    stacklevel=2,
                )
