"""Tables without an annotation get their gradients back; the composable path (shard + plain DDP). 2 ranks."""

from __future__ import annotations

from functools import partial

import pytest

from _composable_bodies import composable, train_with_bare
from overlap_optim.testing import run_cases, selected_cases

SHARDING_TYPES = ("table_wise", "row_wise", "data_parallel")
RANK_CASES = {f"bare/{st}": partial(train_with_bare, sharding_type=st) for st in SHARDING_TYPES}  # one spawned group
RANK_CASES["composable"] = composable  # its directory is bound in the fixture


@pytest.fixture(scope="module")
def ranks(request, tmp_path_factory):
    cases = {**RANK_CASES, "composable": partial(composable, directory=str(tmp_path_factory.mktemp("ckpt")))}
    return run_cases(cases, selected_cases(request, RANK_CASES), timeout=400)


BARE = [f"bare/{st}" for st in SHARDING_TYPES]


@pytest.mark.parametrize("case", BARE)
def test_a_bare_table_is_trained_by_the_users_optimizer_exactly(ranks, case):
    """Compared with the unsharded model and the same user optimizer after every step (inside)."""
    per_rank = ranks[case]
    assert per_rank[0]["moved"] > 1e-3
    holders = [r for r in per_rank if "ebc.embedding_bags.bare.weight" in r["unoptimized"]]
    assert holders, "no rank handed the bare table to the user"
    for rank in holders:
        assert rank["grads_back"] == [True, True, True]
    for rank in per_rank:
        assert not any("bare" in key for key in rank["optimized"])
        assert {"ebc.embedding_bags.adam.weight", "ebc.embedding_bags.sgd.weight"} <= set(rank["optimized"])


@pytest.mark.parametrize("case", BARE)
def test_get_optimizers_warns_once_and_lists_the_bare_parameters(ranks, case):
    for rank in ranks[case]:
        assert len(rank["warnings"]) == 1, rank["warnings"]
        assert "dense.0.weight" in rank["warnings"][0]
        if "ebc.embedding_bags.bare.weight" in rank["unoptimized"]:
            assert "ebc.embedding_bags.bare.weight" in rank["warnings"][0]


@pytest.mark.parametrize("case", ["bare/table_wise"])
def test_describe_shows_the_bare_table_handed_back_and_the_others_in_their_kernels(ranks, case):
    rows = ranks[case][0]["describe"].splitlines()[2:]
    bare_rows = [r for r in rows if "| bare |" in r]
    assert bare_rows and all(".grad handed back to your optimizer" in r for r in bare_rows)
    assert any("| adam |" in r and "fallback" in r for r in rows)
    assert any("| sgd |" in r and "fused EXACT_SGD" in r for r in rows)


@pytest.mark.parametrize("case", ["composable"])
def test_composable_path_matches_the_unsharded_reference_every_step(ranks, case):
    assert all(r["moved"] > 1e-4 for r in ranks[case])


@pytest.mark.parametrize("case", ["composable"])
def test_composable_state_dict_round_trips(ranks, case):
    assert all(r["round_trip"] for r in ranks[case])


@pytest.mark.parametrize("case", ["composable"])
def test_composable_keys_are_those_of_the_dmp_path_and_a_checkpoint_moves_across(ranks, case):
    for rank in ranks[case]:
        assert rank["layout"] == rank["dmp_layout"]
        assert rank["dense_in_dmp_after_load"] <= 1e-6


@pytest.mark.parametrize("case", ["composable"])
def test_plain_ddp_over_annotated_parameters_without_our_hook_is_refused_at_backward(ranks, case):
    for rank in ranks[case]:
        assert "call overlap_optim.register_optimizer_hook(ddp_model)" in rank["refusal"], rank["refusal"]
