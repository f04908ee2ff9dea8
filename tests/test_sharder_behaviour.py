"""Sharder behaviour beyond parity: grouping, collectives, lazy rows, describe(), coverage (2 ranks)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from overlap_optim.testing import run_cases, selected_cases
from _sharded_parity import grouping_and_describe, lazy_rows, scheduled, with_dense

ALL_TABLES = {f"ebc.embedding_bags.t{i}.weight" for i in range(6)}
WITH_DENSE, SCHEDULED = ("table_wise", "data_parallel"), ("table_wise", "row_wise", "data_parallel")
LAZY = ("table_wise", "row_wise")
RANK_CASES = {  # one spawned group
    **{f"with_dense/{st}": partial(with_dense, sharding_type=st) for st in WITH_DENSE},
    **{f"scheduled/{st}": partial(scheduled, sharding_type=st) for st in SCHEDULED},
    "with_dense_bf16": partial(with_dense, sharding_type="table_wise", comm="bf16"),
    "grouping": grouping_and_describe,
    **{f"lazy/{st}": partial(lazy_rows, sharding_type=st) for st in LAZY},
}


@pytest.fixture(scope="module")
def results(request):
    return run_cases(RANK_CASES, selected_cases(request, RANK_CASES), timeout=600)


@pytest.mark.parametrize("case", ["grouping"])
def test_collectives_per_step_do_not_grow_with_distinct_settings(results, case):
    for grouping in results[case]:
        assert grouping["collectives_one"] > 0
        assert grouping["collectives_six"] == grouping["collectives_one"]


@pytest.mark.parametrize("case", ["grouping"])
def test_one_kernel_per_distinct_setting_and_describe_says_why(results, case):
    one, six = results[case][0]["describe_one"], results[case][0]["describe_six"]
    assert results[case][1]["describe_six"] == six  # every rank gets the whole table
    one_rows = [r for r in one.splitlines()[2:]]
    assert len(one_rows) == 2 and all("SGD(lr=0.1) | fused EXACT_SGD" in r for r in one_rows)  # one kernel a rank
    rows = six.splitlines()[2:]
    assert len(rows) == 6, six  # six settings, six kernels
    tables = sorted(r.split(" | ")[4] for r in rows)
    assert tables == [f"t{i}" for i in range(6)]
    assert sum("fused EXACT_SGD" in r for r in rows) == 2
    assert sum("fused EXACT_ADAGRAD" in r for r in rows) == 1
    from overlap_optim import row_pass

    docs = (Path(__file__).resolve().parents[1] / "docs" / "optimizers.md").read_text()
    if not row_pass.available():  # the docs show the output where the one-pass extension is built
        docs = docs.replace(", in one compiled pass", "")
    assert six in docs, "docs/optimizers.md shows an outdated describe() output"
    fallback = [r for r in rows if "fallback" in r]
    assert len(fallback) == 3
    assert all("FBGEMM has no kernel verified exact on cpu" in r for r in fallback)
    units = {"B": 1, "KiB": 1024, "MiB": 1024**2}
    for row in rows:  # the memory column: held now, and what the planner counts, within 1%
        held, planned = (float(v.split()[0]) * units[v.split()[1]] for v in row.split(" | ")[-1].rstrip(" |").split(" / "))
        assert abs(held - planned) <= 0.01 * planned and planned > 0, row


@pytest.mark.parametrize("case", ["grouping"])
def test_get_optimizers_covers_fused_and_fallback_tables_by_unsharded_fqn(results, case):
    keys = set(results[case][0]["param_keys"]) | set(results[case][1]["param_keys"])
    assert keys == ALL_TABLES
    stepped = set(results[case][0]["stepped_keys"]) | set(results[case][1]["stepped_keys"])
    # Plain SGD keeps no state; the other four settings do.
    assert stepped == ALL_TABLES - {"ebc.embedding_bags.t0.weight", "ebc.embedding_bags.t1.weight"}


@pytest.mark.parametrize("case", ["grouping"])
def test_data_parallel_tables_are_covered_and_described(results, case):
    for grouping in results[case]:
        assert set(grouping["dp_param_keys"]) == ALL_TABLES  # replicated: every rank has every table
        assert set(grouping["dp_stepped_keys"]) == ALL_TABLES - {"ebc.embedding_bags.t0.weight", "ebc.embedding_bags.t1.weight"}
    rows = results[case][0]["dp_describe"].splitlines()[2:]
    assert rows and all("data_parallel" in r and "torch.optim after all-reduce (DDP hook)" in r for r in rows)


@pytest.mark.parametrize("case", [f"lazy/{st}" for st in LAZY])
def test_untouched_rows_and_their_state_do_not_change(results, case):
    per_rank = results[case]
    assert all(r["moved_untouched"] == [] for r in per_rank)
    assert all(r["state_changed"] == [] for r in per_rank)
    assert max(r["moved_touched"] for r in per_rank) > 1e-3, "nothing moved: the check proves nothing"
    assert any(r["adam_state_names"] == ["exp_avg", "exp_avg_sq", "step"] for r in per_rank)


@pytest.mark.parametrize("case", [f"with_dense/{st}" for st in WITH_DENSE])
def test_annotated_dense_layers_in_dmp_step_after_the_all_reduce(results, case):
    """DataParallelWrapper: the MLP's AdamW matches torch.optim every step (compared inside)."""
    moved = results[case][0]
    assert moved["dense"] > 1e-4 and moved["adam"] > 1e-3, (case, moved)


@pytest.mark.parametrize("case", ["with_dense_bf16"])
def test_data_parallel_wrapper_compresses_when_asked(results, case):
    """allreduce_comm_precision="bf16" reaches our hook: close to torch.optim, yet not equal."""
    for outcome in results[case]:
        assert 1e-7 < outcome["dense_diff"] <= 1e-3, outcome


@pytest.mark.parametrize("case", [f"scheduled/{st}" for st in SCHEDULED])
def test_warmup_then_decay_schedule_reaches_fused_fallback_and_dense_every_step(results, case):
    """LambdaLR on get_optimizers(model) over 10 steps equals the same schedule on torch.optim
    (compared inside after every step), fused tables included."""
    moved = results[case][0]
    assert moved["sgd"] > 1e-3 and moved["adagrad"] > 1e-3 and moved["adam"] > 1e-3 and moved["dense"] > 1e-4
