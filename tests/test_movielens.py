"""The MovieLens demo: data fetching and parsing (on a tiny fixture), and a 2-rank smoke run."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import movielens_data  # noqa: E402

TINY = Path(__file__).resolve().parent / "fixtures" / "ml-tiny"


def test_parsing_the_tiny_fixture():
    data = movielens_data.load(TINY)
    # users 1 (17, M, student, 85711), 2 (33, F, artist, 94043), 3 (56, M, student, T8H1N)
    # columns: user, item, age bucket, gender (F=0, M=1), occupation (artist=0, student=1), zip prefix
    assert data.ids.tolist() == [
        [0, 0, 0, 1, 1, 0],
        [0, 1, 0, 1, 1, 0],
        [1, 0, 2, 0, 0, 1],
        [2, 2, 6, 1, 1, 2],
        [1, 2, 2, 0, 0, 1],
    ]
    assert data.labels.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]  # rating >= 4
    assert data.sizes == {"user": 3, "item": 3, "age": 7, "gender": 2, "occupation": 2, "zip": 3, "genre": 4}
    # genres sorted: Action 0, Comedy 1, Drama 2, Thriller 3
    batch = data.batch(torch.tensor([0, 3, 1]))
    genre = batch.sparse_features["genre"]
    assert genre.lengths().tolist() == [2, 3, 1]
    assert genre.values().tolist() == [1, 2, 0, 1, 3, 2]
    assert batch.sparse_features["user"].values().tolist() == [0, 2, 0]
    assert batch.dense_features.shape == (3, 3) and not batch.dense_features.isnan().any()
    assert sorted(torch.cat(list(data.splits.values())).tolist()) == [0, 1, 2, 3, 4]
    assert [len(data.splits[s]) for s in ("train", "val", "test")] == [4, 0, 1]


def test_fetch_uses_data_dir_and_the_cache_and_explains_a_failed_download(tmp_path, monkeypatch):
    assert movielens_data.fetch(tmp_path / "cache", TINY) == TINY
    with pytest.raises(movielens_data.DataUnavailable, match="lacks .*ml-100k.user"):
        partial = tmp_path / "partial"
        partial.mkdir()
        (partial / "ml-100k.inter").write_text("")
        movielens_data.fetch(tmp_path / "cache", partial)

    def no_network(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(movielens_data.subprocess, "run", no_network)
    with pytest.raises(movielens_data.DataUnavailable) as failed:
        movielens_data.fetch(tmp_path / "cache")
    message = str(failed.value)
    assert "pip download --no-deps recbole==1.2.1" in message and "--data-dir" in message
    cached = tmp_path / "cache" / "ml-100k"
    cached.mkdir(parents=True)
    for name in movielens_data.FILES:
        (cached / name).write_text((TINY / name).read_text())
    assert movielens_data.fetch(tmp_path / "cache") == cached  # no download: run() would fail


def _synthetic(directory: Path, users: int = 40, items: int = 50, ratings: int = 900) -> Path:
    """Made-up data in the MovieLens files' format (the smoke test must not need the network)."""
    rng = random.Random(0)
    directory.mkdir()
    jobs, genres = ["artist", "doctor", "student", "writer"], ["Action", "Comedy", "Drama", "Horror"]
    (directory / "ml-100k.user").write_text("user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n" + "".join(
        f"{u}\t{rng.randint(12, 70)}\t{rng.choice('MF')}\t{rng.choice(jobs)}\t{rng.randint(10000, 99999)}\n"
        for u in range(1, users + 1)))
    (directory / "ml-100k.item").write_text("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n" + "".join(
        f"{i}\tFilm {i}\t{rng.randint(1950, 1998)}\t{' '.join(rng.sample(genres, rng.randint(1, 3)))}\n"
        for i in range(1, items + 1)))
    (directory / "ml-100k.inter").write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n" + "".join(
        f"{(u := rng.randint(1, users))}\t{(i := rng.randint(1, items))}\t{min(5, max(1, (u + i) % 5 + rng.randint(0, 1)))}\t{n}\n"
        for n in range(ratings)))
    return directory


def _demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "examples" / "movielens.py"), *args],
                          capture_output=True, text=True, timeout=300)


def test_demo_smoke_on_two_ranks_then_resume(tmp_path):
    data = _synthetic(tmp_path / "data")
    common = ["--data-dir", str(data), "--batch-size", "16", "--world-size", "2", "--out", str(tmp_path / "out")]
    first = _demo(*common, "--epochs", "2")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    out = first.stdout
    assert "fused EXACT_ROWWISE_ADAGRAD" in out and "fallback: torch.optim on touched rows" in out
    assert "epoch 2/2: train loss" in out and "val AUC" in out
    assert "within the 0.005 quality bar" in out
    assert (tmp_path / "out" / "curves.png").stat().st_size > 10_000
    assert (tmp_path / "out" / "ckpt" / "step-00000002" / "COMPLETE").is_file()

    again = _demo(*common, "--epochs", "3", "--resume")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "resumed from step-00000002: epoch 2 of 3 done" in again.stdout
    assert "epoch 1/3" not in again.stdout and "epoch 3/3: train loss" in again.stdout
    history = json.loads((tmp_path / "out" / "ours.json").read_text())["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3]


def test_demo_rejects_bad_flags_and_missing_data_without_a_traceback(tmp_path, capsys):
    import movielens  # in this process: both errors come before any rank starts

    with pytest.raises(SystemExit) as bad:
        movielens.main(["--epochs", "0"])
    assert bad.value.code == 2 and "--epochs must be at least 1, got 0" in capsys.readouterr().err
    assert movielens.main(["--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "lacks" in err and "Traceback" not in err


def test_demo_with_local_sgd_counts_the_dense_all_reduces_and_plots_the_period(tmp_path):
    """`--local-sgd qsr` on tiny data: 2 synchronous warm-up steps, then rounds of 8 local steps, each
    ended by one averaging (and one at each epoch end if a round is open). The AUC bar is for
    MovieLens; on this tiny data it may be missed (exit code 1), the counts may not."""
    data = _synthetic(tmp_path / "data")
    run = _demo("--data-dir", str(data), "--batch-size", "16", "--world-size", "2", "--out", str(tmp_path / "out"),
                "--epochs", "2", "--no-baseline", "--local-sgd", "qsr", "--qsr-alpha", "0", "--qsr-base-period", "8",
                "--qsr-warmup", "2")
    assert run.returncode in (0, 1) and "Traceback" not in run.stderr, run.stdout[-2000:] + run.stderr[-3000:]
    assert "QSR(alpha=0, base_period=8, warmup_steps=2): H from 6 to 8, 6 averagings in 44 steps" in run.stdout
    # synchronous: 44 steps x (1 bucket all-reduce + 1 of the MLPs' clipping norm); QSR clips by each rank's own norm
    assert "synchronous 88 calls" in run.stdout and "QSR 8 calls" in run.stdout, run.stdout[-1500:]
    assert (tmp_path / "out" / "qsr.png").stat().st_size > 10_000
