"""The examples run as a user runs them, and say what they promise."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def test_minimal_example_trains_and_matches_torch_optim(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "minimal.py"), "--steps", "30", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert "step    0  loss" in output
    gap = float(re.search(r"largest weight difference from plain torch.optim: (\S+)", output).group(1))
    assert gap < 1e-6
    saved = torch.load(tmp_path / "minimal_optimizer.pt", weights_only=False)
    assert set(saved["state"]) == {
        "ebc.embedding_bags.user.weight", "ebc.embedding_bags.item.weight",
        "dense.0.weight", "dense.0.bias", "dense.2.weight", "dense.2.bias",
    }


def test_minimal_example_rejects_bad_flags_without_a_traceback(monkeypatch, capsys):
    import minimal  # in this process: argparse refuses before anything runs

    monkeypatch.setattr(sys, "argv", ["minimal.py", "--steps", "0"])
    with pytest.raises(SystemExit) as bad:
        minimal.main()
    assert bad.value.code == 2 and "must be positive, got 0" in capsys.readouterr().err


def test_synthetic_criteo_example_trains_on_two_ranks():
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "synthetic_criteo.py"), "--rows", "500", "--id-rows", "400",
         "--steps", "12", "--batch-size", "16"],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "fused EXACT_ROWWISE_ADAGRAD" in run.stdout and "fallback: torch.optim on touched rows" in run.stdout
    assert re.search(r"loss \S+ \(first 10 steps\) -> \S+ \(last 10\); [\d,]+ samples/s per rank", run.stdout)


def test_synthetic_criteo_example_names_a_bad_table_size(capsys):
    import synthetic_criteo  # in this process: the sizes are checked before any rank starts

    with pytest.raises(SystemExit) as bad:
        synthetic_criteo.main(["--rows", "10,20"])
    assert bad.value.code == 2 and "--rows takes one size or 26 sizes" in capsys.readouterr().err
