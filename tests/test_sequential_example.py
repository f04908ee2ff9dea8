"""The sequential (EmbeddingCollection) example: its samples on made-up data, and a 2-rank run against its baseline."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from sharders import fused_rows

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import sequential_data  # noqa: E402


def _sequences(directory: Path, users: int = 40, items: int = 150, noise: float = 0.0, seed: int = 0) -> Path:
    """Made-up ratings in the MovieLens files' format, written in shuffled order: each user walks the
    items in steps of 3 from a random start (so the next item can be learned), 12 to 24 ratings each;
    with ``noise``, each step jumps to a random item with that probability instead."""
    rng = random.Random(seed)
    directory.mkdir()
    (directory / "ml-100k.user").write_text("user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
                                            + "".join(f"{u}\t30\tM\tstudent\t10000\n" for u in range(1, users + 1)))
    (directory / "ml-100k.item").write_text("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
                                            + "".join(f"{i}\tFilm {i}\t1990\tDrama\n" for i in range(1, items + 1)))
    rows = []
    for user in range(1, users + 1):
        item = rng.randrange(items)
        for t in range(rng.randint(12, 24)):
            rows.append(f"{user}\t{item + 1}\t{rng.randint(1, 5)}\t{1000 * t + user}\n")
            item = rng.randrange(items) if rng.random() < noise else (item + 3) % items
    rng.shuffle(rows)
    (directory / "ml-100k.inter").write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n" + "".join(rows))
    return directory


def test_samples_are_time_ordered_histories_and_held_out_users_are_apart(tmp_path):
    data = sequential_data.load(_sequences(tmp_path / "data"), max_len=5, negatives=100)
    flat = torch.arange(data.items.numel())
    user_of = torch.cumsum((data.starts == flat).long(), 0) - 1  # a user's first item starts its own history
    assert set(user_of[data.train].tolist()).isdisjoint(user_of[data.held_out].tolist())
    assert data.held_out.numel() == 8 and data.item_count == 150  # 20% of 40 users
    # the walk of step 3: each history is the 5 (or fewer) items before its target, oldest first
    samples = data.train[:7]
    kjt = data.batch(samples, sequential_data.training_negatives(data.items[samples], 100, 150, seed=1))
    history, position, candidates = (kjt[f] for f in sequential_data.FEATURES)
    assert history.lengths().tolist() == [1, 2, 3, 4, 5, 5, 5]
    for values, target in zip(history.to_dense(), data.items[samples]):
        assert ((target - values) % 150).tolist() == [3 * (len(values) - i) for i in range(len(values))]
    assert [p.tolist() for p in position.to_dense()][:3] == [[0], [1, 0], [2, 1, 0]]  # 0: the newest
    rows = candidates.values().view(7, 101)
    assert torch.equal(rows[:, 0], data.items[samples]) and not (rows[:, 1:] == rows[:, :1]).any()
    for flat, negatives in zip(data.held_out.tolist(), data.held_out_negatives):
        rated = data.items[user_of == user_of[flat]]
        assert data.items[flat] == rated[-1] and not torch.isin(negatives, rated).any()
        assert negatives.unique().numel() == 100


def _example(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "examples" / "sequential.py"), *args],
                          capture_output=True, text=True, timeout=180)


def test_example_on_two_ranks_trains_as_its_one_process_baseline(tmp_path):
    out, data = tmp_path / "out", _sequences(tmp_path / "data", noise=0.5)
    run = _example("--data-dir", str(data), "--batch-size", "16", "--epochs", "2", "--out", str(out))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    text = run.stdout
    backward = ", compiled backward" if fused_rows.applies(EmbOptimType.EXACT_ROWWISE_ADAGRAD, "cpu") else ""
    row = f"| row_wise | item | RowWiseAdagrad(lr=0.5, eps=1e-08) | fused EXACT_ROWWISE_ADAGRAD{backward} | lazy |"
    assert row in text
    assert "| table_wise | position | Adam(lr=0.03) | fallback: torch.optim on the whole table | dense |" in text
    ours, baseline = (float(x) for x in re.search(r"HR@10: ours (\S+) .*\| baseline (\S+)", text).groups())
    assert abs(ours - baseline) <= 0.01 and "within the 0.01 bar" in text
    steps = re.search(r"the same \(within 1e-05\) for the first (\d+) of (\d+) steps", text)
    expected = 2 * (sequential_data.load(data).train.numel() // 32)  # 2 epochs of global batches of 2 x 16
    assert steps and int(steps[1]) == int(steps[2]) == expected > 20, text[-800:]
    assert float(re.search(r"largest weight difference at the end: (\S+)", text)[1]) < 1e-4
    history = json.loads((out / "sequential.json").read_text())["history"]
    first, last = (sum(h["loss"]) / len(h["loss"]) for h in (history[0], history[-1]))
    assert last < 0.9 * first and ours > 0  # it learned: the parity is not of two idle runs
    assert (out / "sequential.png").stat().st_size > 10_000
    assert "Warning" not in run.stderr, run.stderr[-2000:]


def test_example_rejects_bad_flags_and_too_few_items_without_a_traceback(tmp_path, capsys):
    import sequential  # in this process: both errors come before any rank starts

    with pytest.raises(SystemExit) as bad:
        sequential.main(["--negatives", "0"])
    assert bad.value.code == 2 and "--negatives must be at least 1, got 0" in capsys.readouterr().err
    few = sequential.main(["--data-dir", str(_sequences(tmp_path / "data", items=110)), "--out", str(tmp_path / "out")])
    assert few == 2 and "fewer than 100 unrated items remain" in capsys.readouterr().err
