"""The optimizer state of sharded tables, in the form torch.optim gives the unsharded model.

Every model-parallel table of a sharded EmbeddingBagCollection presents its
state under ``torch.optim``'s names (``sum``, ``exp_avg``, ``step``...) with
the shapes ``torch.optim`` would give the whole table, whatever the kernel or
the plan:

- per-row state is a ``ShardedTensor`` of the whole table's state shape,
  sharded as the table's weight is (row-wise state, ``(rows, 1)``, by rows);
- per-table state (``step``, NAdam's ``mu_product``) is a plain tensor, the
  same on every rank.

FBGEMM's fused state is translated: EXACT_ADAGRAD's ``momentum1`` is torch's
``sum``, EXACT_ROWWISE_ADAGRAD's ``(rows,)`` ``momentum1`` is torchrec
``RowWiseAdagrad``'s ``(rows, 1)`` ``sum``, and ``step`` counts the backward
passes that reached the kernel (FBGEMM keeps none for Adagrad).

So the keys and shapes are those of the unsharded model's ``torch.optim``
state, and ``torch.distributed.checkpoint`` can load a checkpoint into any
other plan or world size: it reads each rank's pieces from whatever pieces
were saved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from overlap_optim.spec import AnnotationGroup
from overlap_optim.update import TableOptimizer
from sharders.fbgemm import FUSED_ROW_STATE
from sharders.layerwise import LAYOUTS, sharded_state_layouts, split_axis

__all__ = ["ShardedTables"]

@dataclasses.dataclass
class _Piece:
    """One local shard of a table and where its optimizer state lives."""

    metadata: ShardMetadata  # of the weight shard
    kernel: Any = None  # a fused kernel, with its table index
    index: int = 0
    rows: TableOptimizer | None = None  # or the fallback's table optimizer

    def row_state(self, row_names: dict[str, str]) -> dict[str, torch.Tensor]:
        if self.rows is not None:
            return self.rows.row_state
        states = self.kernel.emb_module.split_optimizer_states()[self.index]
        return {name: (t.view(-1, 1) if layout == "row" else t) for (name, layout), t in zip(row_names.items(), states)}

    def table_state(self, scalar_names: list[str]) -> dict[str, Any]:
        if self.rows is not None:
            return dict(self.rows.table_state)
        return {"step": torch.tensor(float(self.kernel.overlap_steps))} if scalar_names else {}

    def has_state(self) -> bool:
        return self.rows is None or bool(self.rows.state)

    def has_real_state(self) -> bool:
        """State that is not an init_state placeholder; a fused table's once it has stepped."""
        if self.rows is None:
            return self.kernel.overlap_steps > 0
        return bool(self.rows.state) and not self.rows.placeholder_state


@dataclasses.dataclass
class _Table:
    name: str
    group: AnnotationGroup
    size: tuple[int, int]
    dtype: torch.dtype
    shards: list[ShardMetadata]  # every shard of the weight, on every rank
    row_names: dict[str, str]  # sharded state name -> a layout of sharders.layerwise.LAYOUTS
    scalar_names: list[str]  # per-table (or replicated) state names
    pieces: list[_Piece]


class ShardedTables:
    """The model-parallel tables of one sharded EBC and their torch.optim-form state.

    ``state_dict()`` is a collective over the module's process group when some
    table lives on another rank: call it on every rank.
    """

    def __init__(self, sharded: torch.nn.Module, decisions: dict[str, Any], process_group: Any) -> None:
        self.process_group = process_group
        self.weights: dict[str, Any] = dict(sharded._model_parallel_name_to_sharded_tensor)
        self.tables: dict[str, _Table] = {}
        pieces = _local_pieces(sharded)
        for name, weight in list(self.weights.items()):
            decision = decisions[name]
            if decision.group is None:  # no annotation: the user's optimizer keeps its state
                del self.weights[name]
                continue
            if decision.kernel == "fused":
                fused = FUSED_ROW_STATE[decision.choice.fbgemm_kwargs["optimizer"]]
                row_names = {name: "row" if rowwise else "element" for name, rowwise in fused.items()}
                scalars = ["step"] if row_names else []
            else:
                spec = decision.group.spec
                if decision.cross_shard:  # factors may be sharded or whole, by the split axis
                    row_names = sharded_state_layouts(spec, split_axis(decision))
                else:  # what the table optimizer slices by rows
                    row_names = {n: spec.state[n].layout for n in spec.row_keys()}
                scalars = [n for n in spec.state if n not in row_names]
            self.tables[name] = _Table(
                name,
                decision.group,
                tuple(weight.metadata().size),
                weight.metadata().tensor_properties.dtype,
                list(weight.metadata().shards_metadata),
                row_names,
                scalars,
                pieces.get(name, []),
            )

    def keys(self) -> list[str]:
        """Table keys, relative to the sharded module: ``embedding_bags.<table>.weight``."""
        return [f"embedding_bags.{t}.weight" for t in self.tables]

    def weight(self, key: str) -> Any:
        """The table's weight (TorchRec's ``ShardedTensor``) for a key of :meth:`keys`."""
        return self.weights[_table_of(key)]

    def groups(self) -> Iterator[tuple[str, AnnotationGroup]]:
        for key, table in zip(self.keys(), self.tables.values()):
            yield key, table.group

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """``{key: {torch.optim state name: value}}``; tables without state are left out."""
        scalars = self._gathered_scalars()
        out = {}
        for key, table in zip(self.keys(), self.tables.values()):
            if scalars[table.name] is None:
                continue
            state = {name: self._sharded(table, name) for name in table.row_names}
            state.update(scalars[table.name])
            if state:
                out[key] = state
        return out

    def init_state(self) -> None:
        """Give every local fallback shard its (placeholder) state; fused state always exists."""
        for table in self.tables.values():
            for piece in table.pieces:
                if piece.rows is not None:
                    piece.rows.init_state()

    def drop_placeholder_state(self) -> None:
        """Undo :meth:`init_state` where nothing was loaded over it."""
        for table in self.tables.values():
            for piece in table.pieces:
                if piece.rows is not None:
                    piece.rows.drop_placeholder_state()

    def keys_with_state(self) -> list[str]:
        """Keys of the tables with real state on some rank (a collective, like :meth:`state_dict`)."""
        local = [t.name for t in self.tables.values() if any(p.has_real_state() for p in t.pieces)]
        if dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            gathered: list[Any] = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(gathered, local, group=self.process_group)
            local = [name for part in gathered for name in part]
        held = set(local)
        return [key for key, name in zip(self.keys(), self.tables) if name in held]

    def check(self, key: str, saved: dict[str, Any]) -> None:
        """Raise ValueError, naming ``key``, if ``saved`` cannot be loaded into this table."""
        table = self.tables[_table_of(key)]
        if not saved:
            return
        expected = set(table.row_names) | set(table.scalar_names)
        if set(saved) != expected:
            raise ValueError(
                f"{key}: the state dict holds state {sorted(saved)}, the table's "
                f"{table.group.optimizer_class.__name__} keeps {sorted(expected)}"
            )
        for name in table.row_names:
            shape = self._global_shape(table, name)
            value = saved[name]
            if tuple(value.shape) != shape:
                raise ValueError(f"{key}.{name}: shape {tuple(value.shape)} in the state dict, {shape} here")
            for piece in table.pieces:
                self._slice(value, table, name, piece)  # raises if a piece is missing

    def load(self, key: str, saved: dict[str, Any]) -> None:
        """Copy ``saved`` (already checked) into the kernels' state."""
        table = self.tables[_table_of(key)]
        for piece in table.pieces:
            rows = {name: self._slice(saved[name], table, name, piece) for name in table.row_names}
            scalars = {n: v for n, v in saved.items() if n not in table.row_names}
            if piece.rows is not None:
                piece.rows.load_state({**rows, **scalars})
                continue
            for name, target in piece.row_state(table.row_names).items():
                target.copy_(rows[name].view_as(target))
            if "step" in scalars:
                piece.kernel.overlap_steps = int(float(scalars["step"]))

    # -- internals --

    def _gathered_scalars(self) -> dict[str, dict[str, Any] | None]:
        """Per table, its per-table state from a rank that holds it (None: no state yet)."""
        local = {}
        for table in self.tables.values():
            held = [p for p in table.pieces if p.has_state()]
            local[table.name] = held[0].table_state(table.scalar_names) if held else None
        if not (dist.is_initialized() and dist.get_world_size(self.process_group) > 1):
            return local
        gathered: list[Any] = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(gathered, local, group=self.process_group)
        return {
            name: next((part[name] for part in gathered if part[name] is not None), None) for name in self.tables
        }

    def _global_shape(self, table: _Table, name: str) -> tuple[int, ...]:
        return LAYOUTS[table.row_names[name]](*table.size)

    def _state_metadata(self, table: _Table, name: str, shard: ShardMetadata) -> ShardMetadata:
        """The piece of a state entry that the weight shard ``shard`` holds."""
        layout = LAYOUTS[table.row_names[name]]
        (row, col), (rows, cols) = shard.shard_offsets, shard.shard_sizes
        return ShardMetadata(list(layout(row, col, zero=0)), list(layout(rows, cols, zero=1)), shard.placement)

    def _sharded(self, table: _Table, name: str) -> ShardedTensor:
        metadata = ShardedTensorMetadata(
            shards_metadata=[self._state_metadata(table, name, s) for s in table.shards],
            size=torch.Size(self._global_shape(table, name)),
            tensor_properties=TensorProperties(dtype=table.dtype),
        )
        local = [
            Shard(piece.row_state(table.row_names)[name], self._state_metadata(table, name, piece.metadata))
            for piece in table.pieces
        ]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local, metadata, process_group=self.process_group
        )

    def _slice(self, value: Any, table: _Table, name: str, piece: _Piece) -> torch.Tensor:
        """The part of a saved state tensor that ``piece`` holds."""
        md = self._state_metadata(table, name, piece.metadata)
        offsets, sizes = list(md.shard_offsets), list(md.shard_sizes)
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                if list(shard.metadata.shard_offsets) == offsets and list(shard.metadata.shard_sizes) == sizes:
                    return shard.tensor
            raise ValueError(f"embedding_bags.{table.name}.weight.{name}: no local piece at offsets {offsets}")
        return value[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


def _table_of(key: str) -> str:
    return key[len("embedding_bags.") : -len(".weight")]


def _local_pieces(sharded: torch.nn.Module) -> dict[str, list[_Piece]]:
    """table -> the local shards of it in fused or fallback kernels."""
    from torch.nn.parallel import DistributedDataParallel

    pieces: dict[str, list[_Piece]] = {}
    for lookup in sharded._lookups:
        if isinstance(lookup, DistributedDataParallel):
            continue
        for kernel in getattr(lookup, "_emb_modules", []):
            rows = getattr(kernel, "row_optimizers", None)
            for index, config in enumerate(kernel.config.embedding_tables):
                piece = _Piece(config.local_metadata, kernel, index, rows[index] if rows is not None else None)
                pieces.setdefault(config.name, []).append(piece)
    return pieces

