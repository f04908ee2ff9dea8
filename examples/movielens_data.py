"""MovieLens-100k for the demo: fetched from the recbole wheel on PyPI, parsed into DLRM batches.

The machine reaches PyPI and nothing else, and the wheel of ``recbole==1.2.1``
ships MovieLens-100k in RecBole's atomic format. :func:`fetch` downloads that
wheel with ``pip download --no-deps`` into a cache directory and extracts the
three files it needs; recbole itself is never installed. :func:`load` turns
them into tensors:

- label: rating >= 4;
- sparse features: user id, item id, age bucket, gender, occupation, zip
  prefix (first two characters), and the item's genres as a multi-hot bag;
- dense features: release year, and the log number of ratings of the user and
  of the item in the training split, each standardised with training statistics;
- split: a random permutation with a fixed seed, 80% train, 10% validation,
  10% test.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["FILES", "DataUnavailable", "fetch", "load", "MovieLens", "SPARSE", "DENSE", "add_run_arguments"]

WHEEL = "recbole==1.2.1"
FILES = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")
_IN_WHEEL = "recbole/dataset_example/ml-100k/"
SPARSE = ("user", "item", "age", "gender", "occupation", "zip", "genre")
DENSE = ("year", "user_count", "item_count")
_AGE_EDGES = (18, 25, 35, 45, 50, 56)  # MovieLens-1M's age groups


class DataUnavailable(RuntimeError):
    """The data could not be fetched; the message says what was tried and what to do."""


def fetch(cache_dir: Path, data_dir: Path | None = None) -> Path:
    """The directory holding :data:`FILES`: ``data_dir`` if given, else the cache, filled on first use."""
    if data_dir is not None:
        missing = [f for f in FILES if not (Path(data_dir) / f).is_file()]
        if missing:
            raise DataUnavailable(f"--data-dir {data_dir} lacks {missing}; it needs {list(FILES)}")
        return Path(data_dir)
    target = Path(cache_dir) / "ml-100k"
    if all((target / f).is_file() for f in FILES):
        return target
    wheels = Path(cache_dir) / "wheel"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", str(wheels),
               "--disable-pip-version-check", "-q"]
    done = subprocess.run(command, capture_output=True, text=True)
    found = sorted(wheels.glob("recbole-*.whl"))
    if done.returncode != 0 or not found:
        raise DataUnavailable(
            f"could not download MovieLens-100k: tried `{' '.join(command[2:7])}` (the {WHEEL} wheel on PyPI "
            f"ships it), which failed: {done.stderr.strip()[-400:] or 'no wheel'}.\n"
            f"Supply the files by hand instead: put {', '.join(FILES)} (from {_IN_WHEEL} inside that wheel) "
            "in a directory and pass --data-dir DIR."
        )
    target.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[-1]) as wheel:
        for name in FILES:
            (target / name).write_bytes(wheel.read(_IN_WHEEL + name))
    return target


def _read(path: Path) -> tuple[list[str], list[list[str]]]:
    """RecBole's atomic format: a tab-separated header of ``name:type`` fields, then rows."""
    lines = path.read_text(encoding="latin-1").splitlines()
    header = [field.split(":")[0] for field in lines[0].split("\t")]
    rows = [line.split("\t") for line in lines[1:] if line.strip()]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"{path.name}: row {row!r} has {len(row)} fields, the header {len(header)}")
    return header, rows


def _vocab(values: list[str]) -> dict[str, int]:
    return {v: i for i, v in enumerate(sorted(set(values)))}


@dataclass
class MovieLens:
    """Every rating as features; ``splits[name]`` are sample indices."""

    ids: torch.Tensor  # (N, 6) int64: user, item, age, gender, occupation, zip
    genre_offsets: torch.Tensor  # (items + 1,) into genre_values, by item index
    genre_values: torch.Tensor
    dense: torch.Tensor  # (N, 3) float32
    labels: torch.Tensor  # (N,) float32
    sizes: dict[str, int]  # rows of each sparse feature's table
    splits: dict[str, torch.Tensor]

    def batch(self, index: torch.Tensor) -> Batch:
        """The samples ``index`` as a TorchRec ``Batch`` (features keyed as :data:`SPARSE`)."""
        ids = self.ids[index]
        items = ids[:, 1]
        starts, ends = self.genre_offsets[items], self.genre_offsets[items + 1]
        genre_lengths = ends - starts
        genre = torch.cat([self.genre_values[s:e] for s, e in zip(starts.tolist(), ends.tolist())]) \
            if index.numel() else torch.empty(0, dtype=torch.long)
        ones = torch.ones(index.numel(), dtype=torch.long)
        lengths = torch.cat([ones] * 6 + [genre_lengths])
        values = torch.cat([ids.t().reshape(-1), genre])
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(SPARSE), values=values, lengths=lengths)
        return Batch(dense_features=self.dense[index], sparse_features=kjt, labels=self.labels[index])


def load(data_dir: Path, seed: int = 0, limit: int | None = None) -> MovieLens:
    """Parse the three files of ``data_dir``; ``limit`` keeps the first ``limit`` ratings (smoke tests)."""
    _, inter = _read(Path(data_dir) / "ml-100k.inter")
    _, users = _read(Path(data_dir) / "ml-100k.user")
    _, items = _read(Path(data_dir) / "ml-100k.item")
    inter = inter[:limit] if limit else inter
    user_index = {row[0]: i for i, row in enumerate(users)}
    item_index = {row[0]: i for i, row in enumerate(items)}
    genders = _vocab([r[2] for r in users])
    jobs = _vocab([r[3] for r in users])
    zips = _vocab([r[4][:2] for r in users])
    genres = _vocab([g for r in items for g in r[3].split()])
    user_features = [
        (sum(int(r[1]) >= e for e in _AGE_EDGES), genders[r[2]], jobs[r[3]], zips[r[4][:2]]) for r in users
    ]
    unknown = [r for r in inter if r[0] not in user_index or r[1] not in item_index]
    if unknown:
        raise ValueError(f"ml-100k.inter: {len(unknown)} ratings of unknown users or items, e.g. {unknown[0]}")
    ids = torch.tensor(
        [(user_index[r[0]], item_index[r[1]], *user_features[user_index[r[0]]]) for r in inter], dtype=torch.long
    )
    labels = torch.tensor([float(float(r[2]) >= 4) for r in inter])
    item_genres = [[genres[g] for g in r[3].split()] for r in items]
    offsets = torch.tensor([0] + [len(g) for g in item_genres]).cumsum(0)
    values = torch.tensor([g for gs in item_genres for g in gs], dtype=torch.long)

    order = torch.randperm(len(inter), generator=torch.Generator().manual_seed(seed))
    n_train, n_val = int(0.8 * len(order)), int(0.1 * len(order))
    splits = {"train": order[:n_train], "val": order[n_train : n_train + n_val], "test": order[n_train + n_val :]}
    train = splits["train"]
    user_count = torch.bincount(ids[train, 0], minlength=len(users)).float()
    item_count = torch.bincount(ids[train, 1], minlength=len(items)).float()
    years = [float(r[2]) if r[2].strip().isdigit() else math.nan for r in items]
    year = torch.tensor(years)[ids[:, 1]]
    dense = torch.stack([year, user_count.log1p()[ids[:, 0]], item_count.log1p()[ids[:, 1]]], dim=1)
    mean = dense[train].nanmean(0)
    dense = torch.where(dense.isnan(), mean, dense)
    std = dense[train].std(0).clamp(min=1e-6)
    dense = ((dense - mean) / std).float()
    sizes = {"user": len(users), "item": len(items), "age": len(_AGE_EDGES) + 1, "gender": len(genders),
             "occupation": len(jobs), "zip": len(zips), "genre": len(genres)}
    return MovieLens(ids, offsets, values, dense, labels, sizes, splits)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every MovieLens example takes: epochs, batch size, ranks, where to write, where the data is."""
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256, help="per rank; the global batch is world x this")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    parser.add_argument("--data-dir", type=Path, default=None, help=f"a directory holding {list(FILES)}")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "overlap-optim")
