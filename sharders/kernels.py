"""Table kernels: one protocol, one class per kind.

Every table of a sharded module runs in one kind of kernel. A kind is one class;
the registry (:mod:`sharders.kinds`: each kind's class, when it runs a table,
and its install order) picks it, and from then on the class owns the table:

| kind | class (module) | update | semantics |
| --- | --- | --- | --- |
| ``USER`` | :class:`UserTable` (here) | none: ``.grad`` goes to the user's optimizer | user |
| ``FROZEN`` | ``FrozenTable`` (:mod:`sharders.frozen`) | none: looked up only | frozen |
| ``FUSED`` | ``FusedTable`` (:mod:`sharders.fbgemm`) | FBGEMM's fused TBE backward | lazy |
| ``LAZY`` | ``LazyTable`` (:mod:`sharders.fallback`) | torch.optim on the touched rows | lazy |
| ``DENSE`` | ``DenseTable`` (:mod:`sharders.fallback`) | torch.optim on the whole shard | dense |
| ``CROSS_SHARD`` | ``CrossShardTable`` (:mod:`sharders.cross_shard`) | half per shard, statistics in the end-of-backward round | dense |
| ``DATA_PARALLEL`` | ``DataParallelTable`` (:mod:`sharders.data_parallel`) | torch.optim in the DDP hook | dense |
| ``REPLICATED`` | ``ReplicatedTable`` (:mod:`sharders.replicated`) | torch.optim, averaged in the round | dense |

A kind's class answers every question the rest of the package asks of a table
(:class:`TableKernel`): its name, semantics and family (class attributes), which
TorchRec compute kernel it asks the plan for, which tables may share that kernel, how it takes the kernel over, its state layout and size
in bytes per shard, the state it holds, its placeholder rule (through its
shards' state objects, :class:`ShardState`), its ``describe()`` row, and its
check of settings changed at run time. ``describe``, ``live_settings``,
``table_state`` and the sharder iterate over table kernels; none branches on a
kind.

A new kind is one class in its own module and one registry line, in a sharder's
``kinds=`` (``tests/_recording_kind.py`` and ``tests/_row_kind.py`` are two).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from overlap_optim.clipping import GradientClipping
from overlap_optim.round import EndOfBackwardRound
from overlap_optim.spec import AnnotationGroup

__all__ = [
    "KernelKind", "KernelChoice", "TableDecision", "ShardState", "LocalShard", "TableKernel", "BuildContext",
    "UserTable", "DTYPE_NAMES", "ROW_SPLITTING", "COLUMN_SPLITTING", "split_axis", "LAYOUTS",
]

DTYPE_NAMES = {torch.float32: "FP32", torch.float16: "FP16", torch.bfloat16: "BF16"}  # TorchRec's names of the table dtypes
ROW_SPLITTING = ("row_wise", "table_row_wise")
COLUMN_SPLITTING = ("column_wise", "table_column_wise")

# A sharded state entry's shape, from the table's (rows, cols); ``zero`` fills the other axis
# (0 for offsets, 1 for sizes).
LAYOUTS = {
    "element": lambda rows, cols, zero=1: (rows, cols),
    "row": lambda rows, cols, zero=1: (rows, zero),  # (R, 1): Adafactor's row_var, row-wise Adagrad's sum
    "row_vector": lambda rows, cols, zero=1: (rows,),  # (R,): CAME's row factors
    "column": lambda rows, cols, zero=1: (zero, cols),  # (1, C): Adafactor's col_var
    "column_vector": lambda rows, cols, zero=1: (cols,),  # (C,): CAME's column factors
}


def split_axis(sharding_type: str) -> int:
    """0 for a table split into row shards, 1 for column shards."""
    return 0 if sharding_type in ROW_SPLITTING else 1


class KernelKind(enum.StrEnum):
    """The names of the built-in kinds (:attr:`TableKernel.kind`): strings, as an added kind's name is."""

    USER = "user"
    FROZEN = "frozen"
    FUSED = "fused"
    LAZY = "lazy"
    DENSE = "dense"
    CROSS_SHARD = "cross_shard"
    DATA_PARALLEL = "data_parallel"
    REPLICATED = "replicated"


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Whether FBGEMM computes a table's update exactly.

    Attributes:
        fused: True for an FBGEMM fused TBE kernel, False for the fallback.
        fbgemm_kwargs: for a fused table, the complete translated TBE kwargs
            (``optimizer``, ``learning_rate``, ...); empty for the fallback.
        reason: for the fallback, the setting that prevented fusion.
    """

    fused: bool
    fbgemm_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class TableDecision:
    """Where one table's update runs, and why; made once per table, the same on every rank."""

    table: str
    sharding_type: str
    shape: tuple[int, int]  # the whole table's (rows, dim)
    group: AnnotationGroup | None  # None: no annotation (USER) or frozen (FROZEN)
    choice: KernelChoice
    kind: Any  # its line of the registry (sharders.kinds.Kind): the class that runs it, and its name
    device_type: str = "cpu"
    clip: GradientClipping | None = None  # the gradient clipping set the table is in
    dtype: torch.dtype = torch.float32  # what its weights are stored in (its config's data_type)


class ShardState(Protocol):
    """The optimizer state of one local shard of a table, under torch.optim's names.

    Implemented by the fallback's table optimizers (:mod:`overlap_optim.table_optimizer`,
    :mod:`sharders.cross_shard`) and by ``sharders.fbgemm.FusedShardState``.
    ``init_state`` makes placeholder state that the next step drops unless
    ``load_state`` replaced it: the placeholder rule of
    :class:`overlap_optim.table_optimizer.TableOptimizer`.
    """

    @property
    def state(self) -> dict[str, Any]: ...
    @property
    def row_state(self) -> dict[str, torch.Tensor]: ...
    @property
    def table_state(self) -> dict[str, Any]: ...
    def holds_state(self) -> bool: ...
    def has_real_state(self) -> bool: ...
    def init_state(self) -> None: ...
    def drop_placeholder_state(self) -> None: ...
    def placeholder_written(self) -> bool: ...
    def restore_point(self) -> Callable[[], None]: ...
    def load_state(self, state: dict[str, Any]) -> None: ...


@dataclasses.dataclass
class LocalShard:
    """One shard of a table held on this rank: where it sits (TorchRec's ``ShardMetadata``)
    and its optimizer state."""

    metadata: Any
    state: ShardState


@dataclasses.dataclass
class BuildContext:
    """What a kind needs to take over TorchRec's kernels of one sharded module."""

    sharded: nn.Module
    process_group: Any
    device_type: str
    round: EndOfBackwardRound
    tables: dict[str, TableKernel]
    tables_attr: str = "embedding_bags"  # where the sharded module keeps its tables (``embeddings`` for an EC)

    def table_module(self, table: str) -> nn.Module:
        """The sharded module's submodule that holds ``table``'s weight."""
        return getattr(self.sharded, self.tables_attr)[table]


class TableKernel:
    """One table of a sharded module and the kind of kernel that runs it (on every rank).

    ``shards`` are this rank's shards of the table (none where another rank holds it).
    A kind's class sets :attr:`kind`, :attr:`semantics` and :attr:`family`, and overrides what
    differs; the registry (:mod:`sharders.kinds`) picks it.
    """

    kind: ClassVar[str]  # its name, unique among the kinds (a KernelKind for the built-in ones)
    # "lazy": only the rows a batch touched change; "dense": every row steps (a zero gradient where
    # untouched); "user": not ours to step; "frozen": never stepped.
    semantics: ClassVar[str]
    family: ClassVar[str]  # the family of kernel that runs it, for people: fused, fallback, user, frozen...
    compute_kernel: ClassVar[str | None] = "dense"  # asked of the plan; None: the plan's own (data parallel)
    sharded_state: ClassVar[bool] = True  # its state is a sharded table's (sharders.table_state); else none, or on its weight
    # The compute-kernel names a plan may give it ("fused" is how TorchRec's planner names every
    # model-parallel kernel: its plan validation allows "dense" on data_parallel only).
    plan_kernels: ClassVar[frozenset[str]] = frozenset({"dense", "fused"})
    # The weight dtypes it runs exactly; for any other, why not (the refusal names the table and this).
    precisions: ClassVar[frozenset[torch.dtype]] = frozenset({torch.float32})
    float32_only: ClassVar[str] = "its FP16 and BF16 forms are not built yet"
    # Whether it keeps an annotation's state_dtype (overlap_optim.state_precision) exactly.
    low_precision_state: ClassVar[bool] = False

    def __init__(self, decision: TableDecision) -> None:
        self.decision = decision
        self.shards: list[LocalShard] = []
        self.row_split_mean = False  # MEAN pooling on row_wise or table_row_wise (set by the sharder)

    @property
    def table(self) -> str:
        return self.decision.table

    @property
    def group(self) -> AnnotationGroup | None:
        return self.decision.group

    @property
    def clip(self) -> GradientClipping | None:
        return self.decision.clip

    @property
    def kernel(self) -> str:
        """The family of kernel that runs it, for people: fused, fallback, user, frozen, data_parallel_hook."""
        return self.family

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.table!r}, {self.decision.sharding_type})"

    # -- placement --

    def batch_key(self) -> Hashable:
        """Tables with equal keys may share one TorchRec kernel (one lookup, one update)."""
        return (self.kind, None if self.group is None else self.group.spec.share_key)

    def kernel_for(self, planned: str) -> str | None:
        """The compute kernel it runs where a plan names ``planned`` (one of :attr:`plan_kernels`);
        None: the plan's own."""
        return self.compute_kernel

    def fbgemm_kwargs(self) -> dict[str, Any]:
        """The fused params TorchRec passes to its kernel for this table (FBGEMM's, for fused ones)."""
        return {}

    def join_round(self, round_: EndOfBackwardRound) -> None:
        """Register this table's slots in the module's end-of-backward round (on every rank, in
        table order), if its step finishes there."""

    @classmethod
    def adopt(cls, kernel: nn.Module, tables: list[TableKernel], context: BuildContext) -> None:
        """Take over TorchRec's ``kernel`` (of a model-parallel lookup) that runs ``tables``, and
        give each table its :class:`LocalShard` states. Kinds that share a kernel (equal
        :meth:`batch_key`) share this method."""

    @classmethod
    def install(cls, tables: list[TableKernel], context: BuildContext) -> None:
        """Once per kind, on every rank, after every kernel is adopted: ``tables`` are all the
        module's tables of this kind, held here or not. Kinds install by their registry line's
        ``install_order`` (:mod:`sharders.kinds`)."""

    # -- state --

    def held_state(self, metadata: Any, weight: torch.Tensor | None) -> dict[str, Any]:
        """The optimizer state this rank holds for the shard at ``metadata`` (TorchRec's
        ``ShardMetadata``), for ``describe()``'s memory column: tensors by name. ``weight``: the
        sharded module's weight of the table."""
        for piece in self.shards:
            if piece.metadata is metadata:
                return {k: v for k, v in piece.state.state.items() if k in piece.state.row_state or torch.is_tensor(v)}
        return {}

    def state_layout(self) -> dict[str, str]:
        """State entries saved as sharded tensors: name -> a layout of :data:`LAYOUTS`."""
        return {}

    def scalar_names(self) -> list[str]:
        """State entries saved as plain values, the same on every rank."""
        return []

    def state_bytes(self, shard_shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> int:
        """Bytes of optimizer state one shard of ``shard_shape`` holds (on each rank that holds it)."""
        if self.group is None:
            return 0
        # an annotation's state_dtype (overlap_optim.state_precision) over the state's usual dtype
        return _bytes(self.group.spec.state_shapes(tuple(shard_shape)), self.group.state_dtype or dtype)

    def step_bytes(self, shard_shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> int:
        """Bytes one shard of ``shard_shape`` allocates at the peak of a step beyond its state (a
        shard-sized gradient, say; buffers the size of the batch aside); the planner counts them
        with the shard (:mod:`sharders.planner`)."""
        return 0

    # -- run time --

    def check_live(self) -> None:
        """Raise, naming the table, for a setting changed at run time that this kernel cannot compute.
        Called on every rank before the module's first lookup of each step."""

    def why_no_variable_batch(self) -> str | None:
        """Why this kind cannot take a batch with a variable batch size per feature (VBE), or None
        if it can."""
        return f"it runs as {self.runs_as()}, which has no variable-batch lookup"

    def variable_batch_refusal(self) -> str | None:
        """Why this table cannot take a VBE batch, or None: its kind's reason, or its pooling's.
        Asked on every rank before the module's first lookup of a VBE batch (and at sharding, declared)."""
        if self.row_split_mean:  # TorchRec's divisor would be wrong, or raise IndexError
            return ("MEAN pooling on a row-split table: TorchRec's mean divisor for row_wise and table_row_wise "
                    "tables takes no variable batch size per feature")
        return self.why_no_variable_batch()

    # -- describe() --

    def runs_as(self) -> str:
        raise NotImplementedError

    def why_not_fused(self) -> str:
        return self.decision.choice.reason

    def setting(self) -> str:
        if self.group is None:
            return "none"
        kwargs = ", ".join(f"{k}={v!r}" for k, v in self.group.optimizer_kwargs.items())
        return f"{self.group.optimizer_class.__name__}({kwargs})"


def _bytes(shapes: dict[str, Any], dtype: torch.dtype) -> int:
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(math.prod(s) * size for s in shapes.values() if isinstance(s, tuple))


class UserTable(TableKernel):
    """No annotation: TorchRec's dense kernel; the gradient stays on the weight's ``.grad`` for
    the user's own optimizer (``overlap_optim.unoptimized_parameters``)."""

    kind = KernelKind.USER
    semantics = "user"
    family = "user"
    sharded_state = False
    float32_only = "your optimizer would get its gradient in the stored dtype, and step it there"

    def runs_as(self) -> str:
        return "dense: .grad handed back to your optimizer"
