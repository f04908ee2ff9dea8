"""A planner that sizes each table's real optimizer state and proposes only what our sharders run.

TorchRec's planner sizes a table's optimizer state with a multiplier read from its
first ``_optimizer_classes`` entry (2 for Adam, 0 for SGD with or without momentum,
1/dim for RowWiseAdagrad, 1 for the rest), and proposes every sharding type a
sharder lists, whether or not the table's optimizer can run there. Our
:class:`EmbeddingShardingPlanner` is TorchRec's, same arguments, with an
enumerator that, for every sharding option of a table sharded by our sharders:

- asks the decision table (:func:`sharders.optimizer_table.decide`) what would
  run it, and drops the option if the sharder would refuse it or run it in
  another compute kernel than the option names (a fallback table offered
  ``fused_uvm_caching`` runs in "dense", in HBM). A table left with
  no option is a ``ValueError`` at plan time naming the table, its optimizer and
  each reason. The option keeps TorchRec's kernel name ("fused" for a
  model-parallel table: TorchRec's plan validation allows "dense" on
  data_parallel only); the sharder runs the table's own kind there, and the
  estimate is that kind's. The names each kind accepts are its
  :attr:`~sharders.kernels.TableKernel.plan_kernels`; a fused table keeps
  ``fused_uvm`` and ``fused_uvm_caching`` (CUDA), where FBGEMM's update is the same;
- sizes its optimizer state per shard exactly, for the kernel that will run it
  (:meth:`sharders.kernels.TableKernel.state_bytes`: FBGEMM's fp32 state for fused
  tables, torch.optim's for the fallback, amsgrad's extra buffer included,
  factored state for cross-shard tables, the whole table's for data-parallel
  ones), plus what the kernel allocates at the peak of a step
  (:meth:`~sharders.kernels.TableKernel.step_bytes`): the shard-sized gradient
  of a dense table; for a cross-shard table, what its optimizer's cross-shard
  form allocates (:meth:`overlap_optim.cross_shard_base.CrossShardOptimizer.step_bytes`:
  no shard-sized gradient for Adafactor, which steps the touched rows; the
  gradient and the shard-sized temporaries made from it for LAMB, LARS and
  CAME; the whole matrix for Muon) and its slot of the round. Buffers the size
  of the batch (the touched rows' gradients) are not counted, as for lazy
  tables. TorchRec's own tensor and I/O sizes are kept; its multiplier is not
  applied.

On CPU the bytes go to DDR; on CUDA to HBM, or to DDR for kernels that keep the
table in host memory (UVM).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner as _TorchRecPlanner
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator import EmbeddingPerfEstimatorFactory
from torchrec.distributed.planner.estimator.config import DEFAULT_PERF_ESTIMATOR
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import PlannerError, ShardingOption, Storage
from torchrec.distributed.sharding_plan import get_default_sharders

from overlap_optim.spec import AnnotationGroup
from sharders import _private
from sharders.collection import CollectionSharder, row_split_mean, stored_dtype
from sharders.kernels import TableKernel
from sharders.evictions import check_evictable, is_ours, refuse_managed_collision
from sharders.optimizer_table import decide
from sharders.storage_reservation import DenseStorageReservation

__all__ = ["EmbeddingShardingPlanner"]

# Compute kernels whose table (and FBGEMM state) lives in host memory on CUDA.
_HOST_KERNELS = {EmbeddingComputeKernel.FUSED_UVM.value, EmbeddingComputeKernel.FUSED_UVM_CACHING.value}


class EmbeddingShardingPlanner(_TorchRecPlanner):
    """Drop-in for TorchRec's ``EmbeddingShardingPlanner`` (same arguments); see the module doc.

    An ``enumerator`` given explicitly is used as given (TorchRec's estimates). Without a
    ``storage_reservation``, the dense part is reserved exactly from its annotations
    (:class:`sharders.storage_reservation.DenseStorageReservation`, 15% of HBM as a margin as in
    TorchRec's default) instead of TorchRec's 6x the dense parameters.

    Example:
        >>> planner = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"))
        >>> plan = planner.collective_plan(model, [ebc_sharder, ec_sharder], pg)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        own = kwargs.get("enumerator") is None and (len(args) < 3 or args[2] is None)
        if len(args) > 3:
            args = (*args[:3], args[3] or DenseStorageReservation(), *args[4:])
        elif kwargs.get("storage_reservation") is None:
            kwargs["storage_reservation"] = DenseStorageReservation()
        super().__init__(*args, **kwargs)
        if own:
            _private.replace_enumerator(self, FittingEnumerator)


    def plan(self, module: nn.Module, sharders: list) -> Any:
        """TorchRec's, after refusing what our sharders refuse for the whole model (a managed-collision
        collection none of ``sharders`` is ours for), before any table is planned."""
        refuse_managed_collision(module, {s.module_type: s for s in sharders})
        return super().plan(module, sharders)

    def collective_plan(self, module: nn.Module, sharders: list | None = None, pg: Any = None) -> Any:
        """TorchRec's: rank 0 plans and broadcasts the plan. Here its error is broadcast too, so that
        a table that cannot run, or a model that does not fit, raises the same error on every rank
        instead of leaving the others waiting."""
        pg = pg if pg is not None else dist.GroupMember.WORLD
        sharders = sharders if sharders is not None else get_default_sharders()

        def outcome() -> tuple[str, Any]:
            try:
                return "plan", self.plan(module, sharders)
            except (PlannerError, ValueError, NotImplementedError) as err:
                return "error", err

        kind, value = invoke_on_rank_and_broadcast_result(pg, 0, outcome)
        if kind == "error":
            raise value
        return value


class FittingEnumerator(EmbeddingEnumerator):
    """TorchRec's enumerator, keeping only runnable options and sizing their state exactly."""

    def __init__(self, topology: Any, batch_size: int, constraints: dict | None = None) -> None:
        estimators = [
            EmbeddingPerfEstimatorFactory.create(DEFAULT_PERF_ESTIMATOR, topology=topology, constraints=constraints),
            _WithoutOptimizerStorage(topology=topology, constraints=constraints),
        ]
        super().__init__(topology=topology, batch_size=batch_size, constraints=constraints, estimator=estimators)
        self._device = topology.compute_device
        self._torch_made: dict[int, dict[str, AnnotationGroup]] = {}
        self._configs: dict[int, dict[str, Any]] = {}  # each collection's table configs, by name

    def enumerate(self, module: nn.Module, sharders: list) -> list[ShardingOption]:
        self._torch_made, self._configs = {}, {}  # this model's (a module's id may be another's later)
        options = super().enumerate(module, sharders)
        kept, refusals = [], {}
        for option in options:
            kernel = self._kernel_of(option)
            if isinstance(kernel, str):
                refusals.setdefault(option.name, []).append(f"{option.sharding_type}: {kernel}")
            else:
                kept.append(option)
        left = {o.name for o in kept}
        unrunnable = sorted(set(refusals) - left)
        if unrunnable:
            raise ValueError(
                "no sharding option the planner may propose can run these tables exactly:\n"
                + "\n".join(f"- table {n!r}: " + "; ".join(dict.fromkeys(refusals[n])) for n in unrunnable)
                + "\nallow another sharding type in its ParameterConstraints"
            )
        return kept

    def populate_estimates(self, sharding_options: list[ShardingOption]) -> None:
        super().populate_estimates(sharding_options)
        for option in sharding_options:
            kernel = self._kernel_of(option)
            if isinstance(kernel, TableKernel):
                for shard in option.shards:
                    # state: float32 unless annotated with a state_dtype; a step's buffers: by the weight's dtype
                    shape = tuple(shard.size)
                    extra = kernel.state_bytes(shape) + kernel.step_bytes(shape, option.tensor.dtype)
                    shard.storage = shard.storage + self._placed(option, extra)

    def _kernel_of(self, option: ShardingOption) -> TableKernel | str | None:
        """The kernel our sharder would run ``option`` in; the refusal message if it would refuse
        it; None for a module our sharders do not shard."""
        path, module = option.module
        sharder = self.sharder_map.get(option.module_type_key)
        evictable = is_ours(sharder)  # a managed-collision collection: our collection sharder runs its tables
        if evictable:
            sharder, module = sharder.collection_sharder, _private.mc_collection_of(module)
        if not isinstance(sharder, CollectionSharder):
            return None
        configs = self._configs.get(id(module))
        if configs is None:
            configs = self._configs[id(module)] = sharder.configs_by_name(module)
        try:
            decision = decide(
                option.name, option.tensor, option.sharding_type, [list(s.offset) for s in option.shards],
                option.compute_kernel, tuple(option.tensor.shape), self._device,
                self._torch_made.setdefault(id(module), {}),
                pinned=sharder.named_in("fallback_tables", path, [option.name]),
                dense=sharder.named_in("dense_tables", path, [option.name]),
                shard_sizes=[list(s.size) for s in option.shards],
                variable_batch=sharder.variable_batch, dtype=stored_dtype(configs[option.name]), kinds=sharder.kinds,
            )
        except (ValueError, NotImplementedError) as err:
            return str(err)
        kernel = decision.kind.cls(decision)
        kernel.row_split_mean = row_split_mean(configs[option.name], option.sharding_type)
        if sharder.variable_batch and kernel.variable_batch_refusal() is not None:
            return f"variable_batch=True: {kernel.variable_batch_refusal()}"
        if evictable:
            check_evictable({option.name: kernel}, path)  # refused whatever the option: raised as it is
        if option.compute_kernel not in kernel.plan_kernels:
            return (f"compute kernel {option.compute_kernel}: the table runs as {kernel.runs_as()}, in "
                    f"{kernel.kernel_for('fused') or 'dense'}, which the sharder would put there instead")
        return kernel

    def _placed(self, option: ShardingOption, size: int) -> Storage:
        if self._device == "cpu" or option.compute_kernel in _HOST_KERNELS:
            return Storage(hbm=0, ddr=size)
        return Storage(hbm=size, ddr=0)


class _WithoutOptimizerStorage(EmbeddingStorageEstimator):
    """TorchRec's storage estimate (tensor and I/O) with its optimizer multiplier left out:
    :class:`FittingEnumerator` adds the exact state."""

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map: Any = None) -> None:
        with _private.optimizer_classes_hidden(option.tensor for option in sharding_options):
            super().estimate(sharding_options, sharder_data_map)
