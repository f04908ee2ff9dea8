"""The dense part of a plan: what each rank holds beside its table shards, sized from the annotations.

TorchRec's planner places tables in what a ``StorageReservation`` leaves of each device.
Its default, ``HeuristicalStorageReservation``, reserves 6x the dense parameters' bytes
("parameter + optimizer (~2x parameter) + ddp (~3x parameter)"); its
``FixedPercentageStorageReservation`` reserves a percentage of HBM only, so on a CPU
topology it reserves nothing for the dense part.

:class:`DenseStorageReservation` reserves what the dense part really holds on each rank under
DDP (DMP's data-parallel wrapper, ours or TorchRec's: ``gradient_as_bucket_view``, so a
gradient is a view of its bucket):

- every parameter and buffer outside the modules the sharders shard, whole on every rank;
- one gradient per trainable parameter: DDP's bucket;
- the optimizer state of each annotated parameter, from its annotation (the state
  ``torch.optim`` would create for that shape: Adam's two buffers and ``step``, amsgrad's third,
  Adafactor's factors);
- for a trainable parameter with no annotation (the user's own optimizer steps it),
  ``unannotated_state`` times its bytes: 2 by default (Adam's).

It keeps ``FixedPercentageStorageReservation``'s margin (a percentage of HBM, as TorchRec's).
:class:`sharders.EmbeddingShardingPlanner` uses it when no ``storage_reservation`` is given.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import PlannerError, PlannerErrorType, Storage, Topology
from torchrec.distributed.planner.utils import sharder_name

from overlap_optim.record import group_of
from sharders import _private
from sharders.kernels import _bytes

__all__ = ["DenseStorageReservation", "dense_bytes"]


def dense_bytes(module: nn.Module, sharders: list, unannotated_state: float = 2.0) -> int:
    """Bytes each rank holds for the part of ``module`` that ``sharders`` do not shard, under DDP:
    parameters and buffers, one gradient per trainable parameter, and each parameter's optimizer
    state (its annotation's; ``unannotated_state`` x its bytes when it has none). Works on meta."""
    sharded = {sharder_name(s.module_type) for s in sharders}
    seen: set[int] = set()
    total = 0

    def visit(child: nn.Module) -> None:
        nonlocal total
        if sharder_name(type(child)) in sharded:
            seen.update(id(t) for t in (*child.parameters(), *child.buffers()))
            return
        for tensor in (*child.parameters(recurse=False), *child.buffers(recurse=False)):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            size = tensor.numel() * tensor.element_size()
            total += size
            if isinstance(tensor, nn.Parameter) and tensor.requires_grad:
                group = group_of(tensor)
                state = (_bytes(group.spec.state_shapes(tuple(tensor.shape)), tensor.dtype) if group is not None
                         else round(unannotated_state * size))
                total += size + state  # the bucket's gradient, and the optimizer state
        for grandchild in child.children():
            visit(grandchild)

    visit(module)
    return total


class DenseStorageReservation(FixedPercentageStorageReservation):
    """TorchRec's ``FixedPercentageStorageReservation(percentage)`` plus the dense part's bytes
    (:func:`dense_bytes`), taken from every device: HBM on a CUDA topology, DDR on CPU.

    Raises:
        ValueError: ``percentage`` outside [0, 1] or ``unannotated_state`` below 0 (at construction).
        PlannerError: the dense part alone does not fit on a device (at plan time).
    """

    def __init__(self, percentage: float = 0.15, unannotated_state: float = 2.0) -> None:
        if not 0.0 <= percentage <= 1.0:
            raise ValueError(f"DenseStorageReservation: percentage must be in [0, 1], got {percentage!r}")
        if unannotated_state < 0:
            raise ValueError(f"DenseStorageReservation: unannotated_state must be at least 0, got {unannotated_state!r}")
        super().__init__(percentage)
        self._unannotated_state = unannotated_state
        _private.record_reservation(self, None, None)  # TorchRec's planner reads them for its logs

    def reserve(self, topology: Topology, batch_size: int, module: nn.Module, sharders: list,
                constraints: dict | None = None) -> Topology:
        reserved = super().reserve(topology, batch_size, module, sharders, constraints)
        size = dense_bytes(module, sharders, self._unannotated_state)
        on_host = topology.compute_device == "cpu"
        dense = Storage(hbm=0 if on_host else size, ddr=size if on_host else 0)
        _private.record_reservation(self, reserved, dense)  # super().reserve recorded the same topology
        for device in reserved.devices:
            device.storage -= dense
            if device.storage.hbm < 0 or device.storage.ddr < 0:
                memory = "DDR" if on_host else "HBM"
                left = (device.storage.ddr if on_host else device.storage.hbm) + size
                raise PlannerError(
                    error_type=PlannerErrorType.INSUFFICIENT_STORAGE,
                    message=f"the dense part needs {size} bytes of {memory} per rank (parameters, DDP's gradient "
                            f"buckets and optimizer state; sharders.dense_bytes) but rank {device.rank} has {left} "
                            "after the reservation's percentage")
        return reserved

    def __repr__(self) -> Any:
        percentage = _private.reservation_percentage(self)
        return f"DenseStorageReservation(percentage={percentage}, unannotated_state={self._unannotated_state})"
