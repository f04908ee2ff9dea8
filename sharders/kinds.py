"""The registry of table kinds: which class runs a table, when, and in what order it installs.

A kind is a :class:`~sharders.kernels.TableKernel` subclass in its own module and one :class:`Kind`
line: the class, its predicate over a table's :class:`TableFacts`, and its install order.
:data:`KINDS` holds the built-in lines; a sharder's ``kinds=`` puts more lines before them
(:func:`check_kinds`). :func:`kind_of` returns the first line whose predicate holds, and the
table's :class:`~sharders.kernels.TableDecision` carries it, so the class is never looked up by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch

from overlap_optim.spec import OptimizerSpec
from sharders.cross_shard import CrossShardTable
from sharders.data_parallel import DataParallelTable
from sharders.fallback import DenseTable, LazyTable
from sharders.fbgemm import FusedTable
from sharders.frozen import FrozenTable
from sharders.kernels import KernelChoice, TableKernel, UserTable
from sharders.replicated import ReplicatedTable

__all__ = ["TableFacts", "Kind", "KINDS", "kind_of", "check_kinds"]


@dataclasses.dataclass(frozen=True)
class TableFacts:
    """What a kind's predicate reads of a table."""

    table: str
    sharding_type: str
    spec: OptimizerSpec | None  # its optimizer; None: no annotation, or frozen
    choice: KernelChoice
    frozen: bool = False  # requires_grad=False when sharded
    cross_shard: bool = False  # split along an axis its optimizer is not separable by; it has a cross-shard form
    dense_requested: bool = False  # named in dense_tables
    dtype: torch.dtype = torch.float32  # what its weights are stored in


@dataclasses.dataclass(frozen=True)
class Kind:
    """One line of the registry.

    Attributes:
        cls: the class that runs the kind's tables (its ``kind`` attribute names it).
        runs: whether the kind runs a table, from its :class:`TableFacts`.
        install_order: the kinds' ``install`` run by this order, lowest first (ties: in the order
            of their first tables).
    """

    cls: type[TableKernel]
    runs: Callable[[TableFacts], bool]
    install_order: int = 0

    @property
    def name(self) -> str:
        return self.cls.kind


KINDS: tuple[Kind, ...] = (
    # Wins over any annotation: torch.optim never steps it. It installs first: it wraps a data-parallel
    # lookup again without its frozen weights, and the others hook the new one.
    Kind(FrozenTable, lambda t: t.frozen, install_order=-1),
    Kind(UserTable, lambda t: t.spec is None),
    # FP16/BF16 on data_parallel: DDP would reduce and step the gradient in the stored dtype. It
    # installs first: it wraps the DDP lookup that the data-parallel kind hooks.
    Kind(ReplicatedTable, lambda t: t.sharding_type == "data_parallel" and t.dtype != torch.float32, install_order=-1),
    Kind(DataParallelTable, lambda t: t.sharding_type == "data_parallel"),
    Kind(FusedTable, lambda t: t.choice.fused),
    Kind(CrossShardTable, lambda t: t.cross_shard),
    Kind(DenseTable, lambda t: t.dense_requested or not t.spec.row_separable),
    Kind(LazyTable, lambda t: True),
)


def kind_of(facts: TableFacts, kinds: tuple[Kind, ...] = KINDS) -> Kind:
    """The first line of ``kinds`` whose predicate holds for ``facts``."""
    return next(kind for kind in kinds if kind.runs(facts))


def check_kinds(added: Iterable[Kind]) -> tuple[Kind, ...]:
    """A sharder's ``kinds=``: its lines, then the built-in ones.

    Raises:
        TypeError: a line that is not a :class:`Kind` of a ``TableKernel`` subclass.
        ValueError: a kind named as another is (a built-in one, or another added one).
    """
    added = tuple(added)
    names: dict[str, type] = {kind.name: kind.cls for kind in KINDS}
    for kind in added:
        if not isinstance(kind, Kind) or not (isinstance(kind.cls, type) and issubclass(kind.cls, TableKernel)):
            raise TypeError(f"kinds takes sharders.kinds.Kind(cls, runs) lines of TableKernel subclasses, got {kind!r}")
        name = getattr(kind.cls, "kind", None)
        if not isinstance(name, str):
            raise TypeError(f"kinds: {kind.cls.__name__}.kind must name the kind with a string, got {name!r}")
        if name in names:
            raise ValueError(f"kinds: {kind.cls.__name__} is named {name!r}, as {names[name].__name__} is")
        names[name] = kind.cls
    return added + KINDS
