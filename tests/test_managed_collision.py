"""Managed-collision collections (2 ranks, gloo): exact under our managed-collision sharders against one
process of TorchRec's remapping and torch.optim (tests/_managed_collision_exact.py), and refused, by
name, on every rank, before any module is sharded, everywhere else.

On the main of 2026-11-27 each of these trained silently wrong or crashed late: our EBC sharder on an
MC module's inner EBC let each rank remap its own batch (after 4 steps one slot held a different id on
each rank); inside TorchRec's MC sharder an evicted slot's new id inherited the old id's Adagrad state
(0.068 off a reference that resets it), and Adam crashed at the first eviction; our planner planned them.
"""

from __future__ import annotations

import functools
import tempfile

import pytest

from _managed_collision_bodies import (
    column_state, inside_torchrecs_managed_collision_sharder, our_planner, our_sharder_on_the_inner_collection,
    torchrecs_collection_sharder_inside_ours, torchrecs_sharder_under_our_wrapper, unannotated,
)
from _managed_collision_exact import (
    SETTINGS, checkpoint_into_a_fresh_model, exact_cases, resharded_resume, resharded_save, rolled_back_in_place,
)
from overlap_optim.testing import run_cases, selected_cases
from sharders.refusals import refusal

REFUSED = {
    "inner_collection": our_sharder_on_the_inner_collection,
    "torchrec_mc_sharder": inside_torchrecs_managed_collision_sharder,
    "planner": our_planner,
}
CASES = {
    **REFUSED,
    "column_state_planner": functools.partial(column_state, planner="ours"),
    "column_state_dmp": functools.partial(column_state, planner="stock"),
    "unannotated": unannotated,
    "stock_inner_sharder": torchrecs_collection_sharder_inside_ours,
    "stock_under_our_wrapper": torchrecs_sharder_under_our_wrapper,
    "exact": exact_cases,
    "checkpoint": checkpoint_into_a_fresh_model,
    "rollback": rolled_back_in_place,
}
DIRECTORY = tempfile.mkdtemp(prefix="overlap-mc-")  # made in the parent: the 2 ranks write, 1 rank reads
CASES["reshard_save"] = functools.partial(resharded_save, directory=DIRECTORY)


@pytest.fixture(scope="module")
def ranks(request):
    return run_cases(CASES, selected_cases(request, CASES), timeout=300)


@pytest.mark.parametrize("case", SETTINGS)
def test_our_managed_collision_sharders_equal_torch_optim_with_evicted_rows_reset(ranks, case):
    """Six steps, 2 ranks, row_wise, an eviction at every step: the table and the head match the
    reference after every step, the reference moved, and slots were evicted."""
    for rank, out in enumerate(ranks["exact"]):
        result = out[case]
        assert result["evicted"] >= 10 and result["moved"] > 0.1, result
        assert max(result["diffs"]) <= 1e-5, f"{case}, rank {rank}: {result['diffs']}"


def test_a_checkpoint_keeps_the_remapping_and_resumes_exactly_in_a_fresh_model(ranks):
    for rank, out in enumerate(ranks["checkpoint"]):
        assert {"_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_counts"} <= set(out["remapping"]), out
        assert out["evicted"] > 0 and max(out["diffs"]) <= 1e-5, f"rank {rank}: {out['diffs']}"


def test_a_state_dict_loaded_back_in_place_a_step_later_resumes_exactly(ranks):
    """TorchRec's MCH module kept counting iterations from where it was: 0.43 off the uninterrupted run."""
    for rank, out in enumerate(ranks["rollback"]):
        assert out["evicted"] > 0 and max(out["diffs"]) <= 1e-5, f"rank {rank}: {out['diffs']}"


@pytest.mark.parametrize("case", REFUSED)
def test_a_managed_collision_collection_given_to_another_sharder_is_refused_before_anything_is_sharded(ranks, case):
    errors = [out["error"] for out in ranks[case]]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("NotImplementedError: ") and refusal("managed_collision").matches(errors[0]), errors[0]
    expected = "EmbeddingBagCollection, the collection inside" if case == "torchrec_mc_sharder" else \
        "ManagedCollisionEmbeddingBagCollection at 'mc'"
    assert expected in errors[0], errors[0]
    assert all(out["sharded"] == [] for out in ranks[case]), [out["sharded"] for out in ranks[case]]


@pytest.mark.parametrize("case,named", [
    ("column_state_planner", "Adafactor keeps state that is not per row"),
    ("column_state_dmp", "Adafactor keeps state that is not per row"),
    ("unannotated", "has no in-backward optimizer"),
])
def test_a_table_whose_evicted_rows_cannot_get_fresh_state_is_refused_by_name_before_sharding(ranks, case, named):
    errors = [out["error"] for out in ranks[case]]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("NotImplementedError: table 't' of the managed-collision collection at 'mc'"), errors[0]
    assert named in errors[0] and refusal("managed_collision_state").matches(errors[0]), errors[0]
    assert all(out["sharded"] == [] for out in ranks[case]), [out["sharded"] for out in ranks[case]]


def test_torchrecs_managed_collision_sharder_under_our_wrapper_is_refused_before_the_model_trains(ranks):
    """Nothing of ours runs before DMP shards it: our wrapper refuses it when DMP hands it the model."""
    errors = [out["error"] for out in ranks["stock_under_our_wrapper"]]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("NotImplementedError: ShardedManagedCollisionEmbeddingBagCollection at 'mc'"), errors[0]
    assert refusal("managed_collision").matches(errors[0]), errors[0]


def test_our_managed_collision_sharder_refuses_torchrecs_collection_sharder_inside(ranks):
    error = ranks["stock_inner_sharder"][0]["error"]
    assert error.startswith("ValueError: ManagedCollisionEmbeddingBagCollectionSharder: ebc_sharder must be "
                            "overlap-optim's collection sharder"), error
    assert "not EmbeddingBagCollectionSharder" in error, error


def test_a_checkpoint_of_other_row_shards_is_refused_by_name_whatever_loads_it(ranks):
    """Saved on 2 ranks (exact until then), loaded on 1: each shard's module remaps into its own
    slots, and TorchRec merges them. ``overlap_optim.checkpoint.load`` refuses with nothing changed;
    ``dcp.load`` of the objects writes the model's tensors in place before its ``load_state_dict``
    refuses, and the next forward refuses too."""
    assert all(max(out["diffs"]) <= 1e-5 for out in ranks["reshard_save"]), ranks["reshard_save"]
    out = run_cases({"reshard_resume": functools.partial(resharded_resume, directory=DIRECTORY)},
                    world_size=1, timeout=300)["reshard_resume"][0]
    expected = "managed-collision table 't': the state dict was saved with its rows in the shards starting at [0, 4], " \
               "this model splits them at [0]"
    for call in ("checkpoint.load", "dcp.load", "forward"):
        assert out[call].startswith(expected), (call, out[call])
        assert refusal("managed_collision_reshard").matches(out[call])
    assert out["unchanged"], out
