"""MovieLens-100k as item sequences, for the sequential example: next-item samples and their batches.

The files come from :func:`movielens_data.fetch` (the recbole wheel on PyPI, cached), read in
RecBole's atomic format by the same reader as the DLRM demo. Every rating counts as an
interaction (implicit feedback). :func:`load` orders each user's items by time (ties in file
order) and splits the users, by a seeded permutation, into training users and held-out users:

- a training sample is one position ``t >= 1`` of a training user's sequence: the target is the
  item at ``t``, the history the (up to) ``max_len`` items before it;
- an evaluation sample is a held-out user's last item (leave-last-out), its history the
  ``max_len`` items before it, ranked against ``negatives`` items that user never rated, drawn
  once with a fixed seed.

A batch is a ``KeyedJaggedTensor`` with three features, all looked up through one
``EmbeddingCollection``: ``history`` (item ids, oldest first), ``position`` (each history item's
recency, 0 for the newest) and ``candidates`` (the target, then its negatives: ``1 + negatives``
item ids per sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import movielens_data

__all__ = ["FEATURES", "Sequences", "load", "training_negatives"]

FEATURES = ("history", "position", "candidates")


@dataclass
class Sequences:
    """Every user's items in time order, flat; a sample is the flat index of its target item."""

    items: torch.Tensor  # (ratings,) item index, user after user, each user's in time order
    starts: torch.Tensor  # (ratings,) where the history of a target at this flat index begins
    train: torch.Tensor  # flat indices of the training targets
    held_out: torch.Tensor  # flat indices of the held-out users' last items
    held_out_negatives: torch.Tensor  # (len(held_out), negatives): items those users never rated
    item_count: int
    max_len: int

    def batch(self, samples: torch.Tensor, negatives: torch.Tensor) -> KeyedJaggedTensor:
        """The ``samples`` (flat target indices) with ``negatives`` (one row per sample) as features."""
        starts = self.starts[samples]
        lengths = samples - starts
        first = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        offset = torch.arange(int(lengths.sum())) - first  # 0 .. length - 1 within each history
        history = self.items[torch.repeat_interleave(starts, lengths) + offset]
        position = torch.repeat_interleave(lengths, lengths) - 1 - offset  # 0: the newest item
        candidates = torch.cat([self.items[samples][:, None], negatives], dim=1)
        return KeyedJaggedTensor.from_lengths_sync(
            keys=list(FEATURES),
            values=torch.cat([history, position, candidates.reshape(-1)]),
            lengths=torch.cat([lengths, lengths, torch.full_like(lengths, candidates.shape[1])]),
        )


def training_negatives(targets: torch.Tensor, count: int, item_count: int, seed: int) -> torch.Tensor:
    """``count`` uniform items per target, never the target itself, fixed by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.randint(0, item_count - 1, (targets.numel(), count), generator=generator)
    return drawn + (drawn >= targets[:, None]).long()  # skip the target: uniform over the others


def _user_sequences(data_dir: Path, limit: int | None) -> tuple[list[list[int]], int]:
    """Each user's item indices in time order (users in file order), and the number of items."""
    _, inter = movielens_data._read(Path(data_dir) / "ml-100k.inter")
    _, items = movielens_data._read(Path(data_dir) / "ml-100k.item")
    item_index = {row[0]: i for i, row in enumerate(items)}
    inter = inter[:limit] if limit else inter
    unknown = [r for r in inter if r[1] not in item_index]
    if unknown:
        raise ValueError(f"ml-100k.inter: {len(unknown)} ratings of unknown items, e.g. {unknown[0]}")
    by_user: dict[str, list[tuple[float, int, int]]] = {}
    for row_number, (user, item, _, timestamp) in enumerate(r[:4] for r in inter):
        by_user.setdefault(user, []).append((float(timestamp), row_number, item_index[item]))
    return [[item for *_, item in sorted(rated)] for rated in by_user.values()], len(items)


def _held_out_negatives(sequences: list[list[int]], count: int, item_count: int, seed: int) -> torch.Tensor:
    """For each sequence, ``count`` items it does not contain, drawn with a fixed seed."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for items in sequences:
        rated = torch.zeros(item_count, dtype=torch.bool)
        rated[items] = True
        if item_count - int(rated.sum()) < count:
            raise ValueError(f"a held-out user rated {int(rated.sum())} of {item_count} items: fewer than "
                             f"{count} unrated items remain to rank against; use fewer negatives")
        order = torch.randperm(item_count, generator=generator)
        rows.append(order[~rated[order]][:count])
    return torch.stack(rows) if rows else torch.empty(0, count, dtype=torch.long)


def load(data_dir: Path, max_len: int = 20, negatives: int = 100, held_out: float = 0.2, seed: int = 0,
         limit: int | None = None) -> Sequences:
    """Parse ``data_dir`` into :class:`Sequences`; ``limit`` keeps the first ``limit`` ratings.

    Users with fewer than 2 ratings have no sample and are dropped. ``held_out`` is the fraction
    of the remaining users held out (at least one).

    Raises:
        ValueError: a rating names an unknown item, fewer than 2 users are left, or a held-out
            user has fewer than ``negatives`` unrated items.
    """
    sequences, item_count = _user_sequences(data_dir, limit)
    sequences = [s for s in sequences if len(s) >= 2]
    if len(sequences) < 2:
        raise ValueError(f"{data_dir}: {len(sequences)} users with 2 or more ratings; the example needs at least 2")
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(seed)).tolist()
    kept_out = set(order[: max(1, round(held_out * len(sequences)))])
    lengths = torch.tensor([len(s) for s in sequences])
    user_start = torch.cumsum(lengths, 0) - lengths
    flat = torch.arange(int(lengths.sum()))
    first_of_user = torch.repeat_interleave(user_start, lengths)
    starts = torch.maximum(first_of_user, flat - max_len)
    out = torch.tensor([u in kept_out for u in range(len(sequences))])
    train = flat[(flat > first_of_user) & ~torch.repeat_interleave(out, lengths)]
    last = (user_start + lengths - 1)[out]
    negatives_out = _held_out_negatives([s for u, s in enumerate(sequences) if u in kept_out], negatives,
                                        item_count, seed + 1)
    items = torch.tensor([i for s in sequences for i in s], dtype=torch.long)
    return Sequences(items, starts, train, last, negatives_out, item_count, max_len)
