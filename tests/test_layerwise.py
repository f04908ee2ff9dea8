"""Layer-wise optimizers on split tables (sharders/layerwise.py), 2 ranks, gloo.

Reference: the optimizer's own package on the unsharded model with the global batch, built
as a user would (``torch.optim.Adafactor``, ``came_pytorch.CAME``, pytorch-optimizer's ``Lamb``
and ``LARS`` and ``GaLore``, ``torch.optim.Muon``), compared after every step within 1e-5 (on split tables: the
ranks record each table's differences, and each table's test asserts them).
Dense semantics: batches that leave rows untouched are compared with the dense reference.
"""

from __future__ import annotations

from functools import partial

import pytest

from overlap_optim.testing import run_cases, selected_cases
from _layerwise_bodies import (
    LAYERWISE, SPLIT_ONLY, SPLITTING, floor_bound, galore_resharded, mixed_model, round_counts, split_table,
    untouched_shard,
)
from _sharded_parity import assert_table_exact

SPLIT = {f"split/{st}/{rows}": partial(split_table, sharding_type=st, cover=rows == "every_row")
         for st in SPLITTING for rows in ("every_row", "some_rows")}
SPLIT_GALORE = {f"{case}/galore": partial(body, settings=SPLIT_ONLY) for case, body in SPLIT.items()}
RANK_CASES = {**SPLIT, **SPLIT_GALORE, "rounds": round_counts, "mixed": mixed_model, "untouched": untouched_shard,
              "floor": floor_bound}


# a GaLore table saved under one plan, loaded under another: (before, after)
RESHARDED = {f"resharded/{a}/{b}": (a, b) for a, b in (("row_wise", "column_wise"), ("column_wise", "table_wise"),
                                                      ("table_wise", "row_wise"))}


@pytest.fixture(scope="module")
def ranks(request, tmp_path_factory):
    cases = {**RANK_CASES, **{case: partial(galore_resharded, directory=str(tmp_path_factory.mktemp("galore")),
                                            before=a, after=b) for case, (a, b) in RESHARDED.items()}}
    return run_cases(cases, selected_cases(request, cases), timeout=600)


@pytest.mark.parametrize("name", LAYERWISE)
@pytest.mark.parametrize("case", SPLIT)
def test_layerwise_optimizers_are_exact_on_split_tables(ranks, case, name):
    per_rank = ranks[case]
    assert_table_exact(per_rank, name, 1e-5, case)
    for out in per_rank:
        assert out["moved"][name] >= 1e-3, f"the reference did not move {name}"


@pytest.mark.parametrize("case", SPLIT_GALORE)
def test_galore_is_exact_on_split_tables(ranks, case):
    """GaLore (pytorch-optimizer, rank 2, a new projection every 2 steps): the table's gradient
    gathered for its projection (overlap_optim/cross_shard_galore.py)."""
    per_rank = ranks[case]
    assert_table_exact(per_rank, "galore", 1e-5, case)
    assert min(out["moved"]["galore"] for out in per_rank) > 1e-3, "the reference did not move"


@pytest.mark.parametrize("case", RESHARDED)
def test_a_galore_checkpoint_reshards_across_plans(ranks, case):
    """GaLore's state (its projector, read at every step between two projections, and its low-rank
    moments) saved with overlap_optim.checkpoint under one sharding type and loaded under another into
    other weights: every step before and after the load within 1e-5 of the package on the unsharded
    model, an Adafactor table beside it."""
    for name in ("galore", "adafactor"):
        assert_table_exact(ranks[case], name, 1e-5, case)
    assert min(out["moved"]["galore"] for out in ranks[case]) > 1e-3


@pytest.mark.parametrize("case", ["rounds"])
def test_one_all_reduce_per_step_carries_every_layerwise_table(ranks, case):
    for rank in ranks[case]:
        counts = rank["counts"]
        assert counts[1] == counts[4] == counts[0] + 1, counts


@pytest.mark.parametrize("case", ["rounds"])
def test_describe_names_the_cross_shard_update(ranks, case):
    rows = [r for r in ranks[case][0]["rows"] if "Adafactor" in r[5]]
    assert rows and all("whole-table statistics across shards" in r[6] for r in rows), ranks[case][0]["rows"]


@pytest.mark.parametrize("case", ["mixed"])
def test_mixed_model_with_muon_on_the_mlp_matches_its_references(ranks, case):
    for moved in ranks[case]:
        still = [n for n, d in moved.items() if d < 1e-3 and not n.startswith("dense.2.bias")]
        assert not still, f"the reference did not move {still}"


@pytest.mark.parametrize("case", ["untouched"])
def test_a_shard_no_batch_reaches_still_takes_part_and_steps(ranks, case):
    for out in ranks[case]:
        assert out["rounds"] == 4, out  # one round per step on both ranks, no deadlock
        # rows 6-11 (the second shard) saw no id; with weight decay they still move (dense
        # semantics), and matched the reference every step
        moved = out["untouched_rows_moved"]
        assert moved["came"] > 1e-3 and moved["lamb"] > 1e-4, out


@pytest.mark.parametrize("case", ["floor"])
def test_adafactor_refuses_the_step_after_its_variance_floor_bound(ranks, case):
    for out in ranks[case]:  # every rank, at the second step, naming the table and the setting
        assert out["step"] == 1, out
        assert "table 'adafactor'" in out["error"] and "eps[0]" in out["error"], out
