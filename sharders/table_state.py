"""The optimizer state of sharded tables, in the form torch.optim gives the unsharded model.

Every model-parallel table of a sharded collection (EBC or EC) presents its
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
from typing import Any
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from overlap_optim import _private
from overlap_optim._state_schema import stock_hint
from overlap_optim.spec import AnnotationGroup
from overlap_optim.table_optimizer import math_dtype
from sharders.kernels import LAYOUTS, LocalShard, TableKernel

__all__ = ["ShardedTables"]


@dataclasses.dataclass
class _Table:
    name: str
    group: AnnotationGroup
    size: tuple[int, int]
    dtype: torch.dtype
    shards: list[Any]  # every shard's ShardMetadata, on every rank
    row_names: dict[str, str]  # sharded state name -> a layout of sharders.kernels.LAYOUTS
    scalar_names: list[str]  # per-table (or replicated) state names
    pieces: list[LocalShard]  # this rank's shards


class ShardedTables:
    """The model-parallel tables of one sharded collection and their torch.optim-form state.

    Built from the module's table kernels: a kernel with ``sharded_state`` gives its
    state layout and its local shards' state objects; no kind is special here.
    ``state_dict()`` is a collective over the module's process group when some
    table lives on another rank: call it on every rank.
    """

    def __init__(
        self, weights: dict[str, Any], kernels: dict[str, TableKernel], process_group: Any, tables_attr: str = "embedding_bags"
    ) -> None:
        """``tables_attr``: where the sharded module keeps its tables (``embeddings`` for an EC)."""
        self.process_group, self.tables_attr = process_group, tables_attr
        # (table, state name) -> (its local tensors, the ShardedTensor over them): made again only for other tensors
        self._made: dict[tuple[str, str], tuple[tuple, Any]] = {}
        self.weights = {name: w for name, w in weights.items() if kernels[name].sharded_state}
        self.tables: dict[str, _Table] = {}
        for name, weight in self.weights.items():
            kernel = kernels[name]
            self.tables[name] = _Table(
                name,
                kernel.group,
                tuple(weight.metadata().size),
                weight.metadata().tensor_properties.dtype,
                list(weight.metadata().shards_metadata),
                kernel.state_layout(),
                kernel.scalar_names(),
                kernel.shards,
            )

    def keys(self) -> list[str]:
        """Table keys, relative to the sharded module: ``<tables_attr>.<table>.weight``."""
        return [f"{self.tables_attr}.{t}.weight" for t in self.tables]

    def weight(self, key: str) -> Any:
        """The table's weight (TorchRec's ``ShardedTensor``) for a key of :meth:`keys`."""
        return self.weights[self._table_of(key)]

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
        """Give every local shard its (placeholder) state, where it has none yet."""
        for table in self.tables.values():
            for piece in table.pieces:
                piece.state.init_state()

    def drop_placeholder_state(self) -> None:
        """Undo :meth:`init_state` where nothing was loaded over it."""
        for table in self.tables.values():
            for piece in table.pieces:
                piece.state.drop_placeholder_state()

    def written_placeholders(self) -> list[str]:
        """Keys of the tables whose placeholder state on this rank was written in place since
        :meth:`init_state` and never loaded (:meth:`load`): a ``dcp.load`` without ``load_state_dict``."""
        return [key for key, t in zip(self.keys(), self.tables.values())
                if any(p.state.placeholder_written() for p in t.pieces)]

    def keys_with_state(self) -> list[str]:
        """Keys of the tables with real state on some rank (a collective, like :meth:`state_dict`)."""
        local = [t.name for t in self.tables.values() if any(_has_state(p, real=True) for p in t.pieces)]
        if dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            gathered: list[Any] = [None] * dist.get_world_size(self.process_group)
            dist.all_gather_object(gathered, local, group=self.process_group)
            local = [name for part in gathered for name in part]
        held = set(local)
        return [key for key, name in zip(self.keys(), self.tables) if name in held]

    def check(self, key: str, saved: dict[str, Any]) -> None:
        """Raise ValueError, naming ``key``, if ``saved`` cannot be loaded into this table."""
        table = self.tables[self._table_of(key)]
        if not saved:
            return
        expected = set(table.row_names) | set(table.scalar_names)
        if set(saved) != expected:
            raise ValueError(
                f"{key}: the state dict holds state {sorted(saved)}, the table's "
                f"{table.group.optimizer_class.__name__} keeps {sorted(expected)}{stock_hint(saved)}"
            )
        for name in table.row_names:
            shape = self._global_shape(table, name)
            value = saved[name]
            if tuple(value.shape) != shape:
                raise ValueError(f"{key}.{name}: shape {tuple(value.shape)} in the state dict, {shape} here")
            for piece in table.pieces:
                self._slice(value, table, name, piece)  # raises if a piece is missing

    def held_locally(self, key: str, saved: dict[str, Any]) -> bool:
        """Whether every piece of ``saved`` that this rank's shards need is on this rank: a plain
        tensor, or a ``ShardedTensor`` split as this plan splits the table (not another plan; and
        none where this plan keeps the entry whole, such as Adafactor's row factor on column shards)."""
        table = self.tables[self._table_of(key)]
        if any(isinstance(v, _private.ShardedTensor) for n, v in saved.items() if n not in table.row_names):
            return False
        for name in table.row_names:
            if isinstance(saved.get(name), _private.ShardedTensor):
                try:
                    for piece in table.pieces:
                        self._slice(saved[name], table, name, piece)
                except ValueError:
                    return False
        return True

    def restore_point(self, key: str) -> Callable[[], None]:
        """A function that puts this rank's state of the table ``key`` back as it is now."""
        restores = [piece.state.restore_point() for piece in self.tables[self._table_of(key)].pieces]

        def restore() -> None:
            for undo in restores:
                undo()
        return restore

    def load(self, key: str, saved: dict[str, Any]) -> None:
        """Copy ``saved`` (already checked) into the kernels' state."""
        table = self.tables[self._table_of(key)]
        for piece in table.pieces:
            rows = {name: self._slice(saved[name], table, name, piece) for name in table.row_names}
            scalars = {n: v for n, v in saved.items() if n not in table.row_names}
            piece.state.load_state({**rows, **scalars})

    def reset_rows(self, table: str, rows: torch.Tensor) -> None:
        """Give ``rows`` (indices into this rank's one shard of ``table``) the state of a row never
        updated: each per-row entry its :attr:`~overlap_optim.spec.StateEntry.fresh` value; the
        per-table entries are left as they are. A table that keeps no state (frozen), or a shard with
        none yet, has nothing to reset."""
        entry = self.tables.get(table)
        if entry is None:
            return
        assert len(entry.pieces) == 1, f"{table}: an eviction names rows of one shard, {len(entry.pieces)} here"
        piece, spec = entry.pieces[0], entry.group.spec
        if not piece.state.has_real_state():
            return
        for name in entry.row_names:
            fresh = spec.state[name].fresh
            piece.state.row_state[name][rows] = 0 if fresh is None else fresh

    # -- internals --

    def _gathered_scalars(self) -> dict[str, dict[str, Any] | None]:
        """Per table, its per-table state from a rank that holds it (None: no state yet)."""
        local = {}
        for table in self.tables.values():
            held = [p for p in table.pieces if _has_state(p)]
            local[table.name] = dict(held[0].state.table_state) if held else None
        if not (dist.is_initialized() and dist.get_world_size(self.process_group) > 1):
            return local
        gathered: list[Any] = [None] * dist.get_world_size(self.process_group)
        packed = {name: None if s is None else {n: _Scalar.of(v) for n, v in s.items()} for name, s in local.items()}
        dist.all_gather_object(gathered, packed, group=self.process_group)
        found = {name: next((part[name] for part in gathered if part[name] is not None), None) for name in self.tables}
        return {name: None if s is None else {n: _Scalar.back(v) for n, v in s.items()} for name, s in found.items()}

    def _global_shape(self, table: _Table, name: str) -> tuple[int, ...]:
        return LAYOUTS[table.row_names[name]](*table.size)

    def _state_metadata(self, table: _Table, name: str, shard: Any) -> Any:
        """The piece of a state entry that the weight shard ``shard`` holds."""
        layout = LAYOUTS[table.row_names[name]]
        (row, col), (rows, cols) = shard.shard_offsets, shard.shard_sizes
        return _private.ShardMetadata(list(layout(row, col, zero=0)), list(layout(rows, cols, zero=1)), shard.placement)

    def _sharded(self, table: _Table, name: str) -> Any:
        """The state entry ``name`` of ``table`` as a ``ShardedTensor`` of the whole table's shape over
        this rank's state tensors, by reference; for a kind whose state is views of buffers it keeps
        for good (``views_kept_buffers``: fused tables), the same object while they are the same."""
        tensors = [piece.state.row_state[name] for piece in table.pieces]
        if not all(getattr(piece.state, "views_kept_buffers", False) for piece in table.pieces):
            return self._make_sharded(table, name, tensors)  # kept, it would hold tensors a step may replace
        key = tuple((id(t), t.data_ptr(), tuple(t.shape)) for t in tensors)
        made = self._made.get((table.name, name))
        if made is None or made[0] != key:
            made = self._made[(table.name, name)] = (key, self._make_sharded(table, name, tensors))
        return made[1]

    def _make_sharded(self, table: _Table, name: str, tensors: list[torch.Tensor]) -> Any:
        metadata = _private.ShardedTensorMetadata(
            shards_metadata=[self._state_metadata(table, name, s) for s in table.shards],
            size=torch.Size(self._global_shape(table, name)),
            # the state's own dtype: its annotation's state_dtype, else float32 for FP16 and BF16 tables
            tensor_properties=_private.TensorProperties(
                dtype=getattr(table.group, "state_dtype", None) or math_dtype(table.dtype)),
        )
        local = [_private.Shard(tensor, self._state_metadata(table, name, piece.metadata))
                 for tensor, piece in zip(tensors, table.pieces)]
        return _private.sharded_tensor_from_local_shards(local, metadata, self.process_group)

    def _slice(self, value: Any, table: _Table, name: str, piece: LocalShard) -> torch.Tensor:
        """The part of a saved state tensor that ``piece`` holds."""
        md = self._state_metadata(table, name, piece.metadata)
        offsets, sizes = list(md.shard_offsets), list(md.shard_sizes)
        if isinstance(value, _private.ShardedTensor):
            for shard in value.local_shards():
                if list(shard.metadata.shard_offsets) == offsets and list(shard.metadata.shard_sizes) == sizes:
                    return shard.tensor
            raise ValueError(f"{self.tables_attr}.{table.name}.weight.{name}: no local piece at offsets {offsets}")
        return value[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]

    def _table_of(self, key: str) -> str:
        return key[len(self.tables_attr) + 1 : -len(".weight")]


class _Scalar(tuple):
    """A 0-d tensor as (value, dtype, device), to gather: pickling a tensor costs far more than a
    number (a state dict of hundreds of tables gathers a step count each)."""

    @classmethod
    def of(cls, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            return cls((value.item(), value.dtype, str(value.device)))
        return value

    @staticmethod
    def back(value: Any) -> Any:
        if isinstance(value, _Scalar):
            number, dtype, device = value
            return torch.tensor(number, dtype=dtype, device=device)
        return value


def _has_state(piece: LocalShard, real: bool = False) -> bool:
    """The one answer to "does this shard have optimizer state": it holds some entry (an optimizer
    that keeps none, plain SGD, never does), and with ``real``, not an ``init_state`` placeholder.
    :meth:`ShardedTables.state_dict` saves what the first answer says, ``load_state_dict`` refuses
    to drop what the second says: a table is in both or in neither."""
    return piece.state.holds_state() and (not real or piece.state.has_real_state())
