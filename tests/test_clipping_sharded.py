"""Gradient clipping on 2 ranks (gloo) against one process on the global batch.

One DMP model holds every kind of kernel (see ``_clipping_bodies``): fused Adagrad and SGD (which
stay fused when clipped by norm, and move to the fallback when clipped by value), fallback Adam (lazy) and RMSprop (dense), cross-shard Adafactor, a data-parallel table,
the MLP under the DDP hook, and an unannotated layer for a user optimizer. Each case clips by
norm 2, norm inf or value, over everything, the dense part or the tables, with a bound at 0.3x
the first step's norm; the body compares every weight (2e-5) and ``total_norm`` (1e-5
relative) with torch's ``clip_grad_norm_`` / ``clip_grad_value_`` after every step.

Mutations: dropping the norm's all-reduce (each rank's norm from its own shards), counting
the DDP-averaged gradients on every rank, and leaving one rank's fused shards out of the norm (their
partial from the compiled backward, ``sharders.fused_rows``), must each be caught by the same comparison.
"""

from __future__ import annotations

from functools import partial

import pytest

from _clipping_bodies import clipped_training, declared_after_sharding, non_finite_step
from overlap_optim.testing import run_cases, selected_cases

HOWS = {"norm2": {"how": "norm"}, "norm_inf": {"how": "norm", "norm_type": float("inf")}, "value": {"how": "value"}}
OVERS = ("everything", "dense", "tables")
CASES = {
    **{f"{h}-{o}": partial(clipped_training, over=o, **kw) for h, kw in HOWS.items() for o in OVERS},
    "partial_batches": partial(clipped_training, over="everything", how="norm", cover=False),
    "mutant_no_all_reduce": partial(clipped_training, over="everything", how="norm", mutate="no_all_reduce"),
    "mutant_replicated_twice": partial(clipped_training, over="everything", how="norm", mutate="replicated_twice"),
    "mutant_drop_shard_partial": partial(clipped_training, over="tables", how="norm", mutate="drop_shard_partial"),
    "declared_after_sharding": declared_after_sharding,
    **{f"non_finite-{o}": partial(non_finite_step, over=o) for o in ("dense", "everything")},
}
EXACT = [c for c in CASES if c.startswith(("norm", "value", "partial"))]


@pytest.fixture(scope="module")
def ranks(request):
    return run_cases(CASES, selected_cases(request, CASES), timeout=400)


@pytest.mark.parametrize("case", EXACT)
def test_clipped_training_equals_torch_clipping_on_the_global_batch(ranks, case):
    for result in ranks[case]:  # the body compared weights and the norm after every step
        still = [n for n, moved in result["moved"].items() if moved < 1e-3]
        assert not still, f"the reference did not move {still}"
        if result["norms"]:
            assert result["bound"] < result["norms"][0][0], "the bound must clip"


def test_fused_tables_stay_fused_when_clipped_by_norm_and_move_when_clipped_by_value(ranks):
    tables, value = ranks["norm2-tables"][0]["kinds"], ranks["value-tables"][0]["kinds"]
    assert tables["fused"] == tables["sgd"] == "fused" and ranks["norm_inf-tables"][0]["kinds"]["fused"] == "fused"
    assert value["fused"] == value["sgd"] == "lazy" and ranks["value-dense"][0]["kinds"]["fused"] == "fused"
    assert tables["factor"] == "cross_shard" and tables["dp"] == "data_parallel" and tables["dense"] == "dense"


def test_partial_batches_clip_the_coalesced_gradient(ranks):
    """Lazy tables: untouched rows count as zero in the norm; the reference is SparseAdam."""
    assert ranks["partial_batches"][0]["kinds"]["adam"] == "lazy"


@pytest.mark.parametrize("case", ["mutant_no_all_reduce", "mutant_replicated_twice", "mutant_drop_shard_partial"])
def test_a_wrong_norm_is_caught(ranks, case):
    if ranks[case][0].get("not_built"):
        pytest.skip("the compiled extension is not built here (no C++ compiler at install)")
    for result in ranks[case]:
        assert result["worst_norm"] > 1e-2 and result["worst_weight"] > 1e-3, result


def test_clipping_declared_on_a_dmps_parameters_is_a_clear_error(ranks):
    for message in ranks["declared_after_sharding"]:
        assert "is already run by" in message and "declare gradient clipping on the unsharded model" in message, message


@pytest.mark.parametrize("case", ["non_finite-dense", "non_finite-everything"])
def test_a_set_whose_norm_is_not_finite_skips_its_own_updates_only(ranks, case):
    """The error is raised on every rank at the step whose norm is inf, and the body compared every
    weight with torch.optim after every step: what is outside the set stepped (the cross-shard
    table's second half included), the set's parameters did not, and the next steps started clean."""
    for result in ranks[case]:
        assert [step for step, _ in result["raised"]] == [1], result["raised"]
        assert "is inf, so they cannot be clipped" in result["raised"][0][1]
        assert result["kinds"]["factor"] == "cross_shard" and result["kinds"]["fused"] == "fused"
        still = [n for n, moved in result["moved"].items() if moved < 1e-3]
        assert not still, f"the reference did not move {still}"
