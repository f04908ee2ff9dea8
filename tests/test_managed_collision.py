"""Managed-collision collections meet our code only to be refused, by class, on every rank, before any
module is sharded (2 ranks, gloo).

On the main of 2026-11-27 each of these trained silently wrong or crashed late: our EBC sharder on an
MC module's inner EBC let each rank remap its own batch (after 4 steps one slot held a different id on
each rank); inside TorchRec's MC sharder an evicted slot's new id inherited the old id's Adagrad state
(0.068 off a reference that resets it), and Adam crashed at the first eviction; our planner planned them.
"""

from __future__ import annotations

import pytest

from _managed_collision_bodies import (
    inside_torchrecs_managed_collision_sharder, our_planner, our_sharder_on_the_inner_collection,
)
from overlap_optim.testing import run_cases, selected_cases
from sharders.refusals import refusal

CASES = {
    "inner_collection": our_sharder_on_the_inner_collection,
    "torchrec_mc_sharder": inside_torchrecs_managed_collision_sharder,
    "planner": our_planner,
}


@pytest.fixture(scope="module")
def ranks(request):
    return run_cases(CASES, selected_cases(request, CASES), timeout=240)


@pytest.mark.parametrize("case", CASES)
def test_a_managed_collision_collection_is_refused_on_every_rank_before_anything_is_sharded(ranks, case):
    errors = [out["error"] for out in ranks[case]]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("NotImplementedError: ") and "managed-collision collection" in errors[0], errors[0]
    assert refusal("managed_collision").matches(errors[0])
    expected = "EmbeddingBagCollection, the collection inside" if case == "torchrec_mc_sharder" else \
        "ManagedCollisionEmbeddingBagCollection at 'mc'"
    assert expected in errors[0], errors[0]
    assert all(out["sharded"] == [] for out in ranks[case]), [out["sharded"] for out in ranks[case]]
