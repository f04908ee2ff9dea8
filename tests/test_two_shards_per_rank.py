"""Two column shards of one table on one rank (TorchRec's planner places wide tables so): fused,
fallback and cross-shard tables stay exactly torch.optim, and a checkpoint round-trips.

Reference: plain torch.optim on the unsharded model, compared after every step inside the ranks.
"""

from __future__ import annotations

import pytest

from overlap_optim.testing import run_cases, selected_cases
from _sharded_parity import two_shards_per_rank

RANK_CASES = {"two_shards": two_shards_per_rank}  # train, save, load, train on: one sequence


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    return run_cases(RANK_CASES, selected_cases(request, RANK_CASES), str(tmp_path_factory.mktemp("ckpt")), timeout=300)


@pytest.mark.parametrize("case", ["two_shards"])
def test_each_rank_holds_two_column_shards_of_every_table(results, case):
    per_rank = results[case]
    for rank, result in enumerate(per_rank):
        for name, pieces in result["pieces"].items():
            assert [(row, shape) for row, _, shape in pieces] == [(0, (12, 4))] * 2, (rank, name, pieces)
        columns = sorted(col for result in per_rank for _, col, _ in result["pieces"]["fallback"])
        assert columns == [0, 4, 8, 12]


@pytest.mark.parametrize("case", ["two_shards"])
def test_fused_fallback_and_cross_shard_tables_match_torch_optim_and_resume(results, case):
    moved = results[case][0]["moved"]  # the comparisons (after every step, across a checkpoint load) ran in the ranks
    assert all(distance > 1e-3 for distance in moved.values()), moved
    runs_as = results[case][0]["runs_as"]
    assert "fused EXACT_ADAGRAD" in runs_as and "fallback: torch.optim on touched rows" in runs_as
    assert "whole-table statistics across shards" in runs_as
    assert "| fallback (2 shards) |" in runs_as and "fallback, fallback" not in runs_as
