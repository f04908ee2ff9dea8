"""Sharded checkpoints: plan-independent keys, and resharding through overlap_optim.checkpoint (gloo)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _models import ManyTableModel
from _reshard_bodies import (
    DENSE, NAMES, SETTINGS, ec_state_dict_then_reshard, interrupted_load, load_on_one_rank, plain_dcp,
    plain_dcp_same_plan, save_then_reshard, state_dict_then_reshard, stock_state_dict_refused,
)
from overlap_optim import apply_optimizer_in_backward, checkpoint, get_optimizers
from overlap_optim.testing import run_cases, selected_cases

HERE = Path(__file__).resolve().parent


TWO_RANKS = {
    "reshard": save_then_reshard,  # plan A trains and saves, plan B loads and trains on: one sequence
    "state_dict/reshard": state_dict_then_reshard,
    "state_dict/reshard/ec": ec_state_dict_then_reshard,
    "state_dict/stock": stock_state_dict_refused,
    "plain_dcp": plain_dcp,
    "plain_dcp/same_plan": plain_dcp_same_plan,
    "state_dict/interrupted": interrupted_load,
}
ONE_RANK = {"one_rank": load_on_one_rank}


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def two(request, directory):
    return run_cases(TWO_RANKS, selected_cases(request, TWO_RANKS), str(directory), timeout=400)


@pytest.fixture(scope="module")
def one(request, two, directory):
    two["reshard"]  # the checkpoint is saved there: if it failed, say so by name
    return run_cases(ONE_RANK, selected_cases(request, ONE_RANK), str(directory), world_size=1, timeout=300)


@pytest.mark.parametrize("case", ["reshard"])
def test_state_keys_and_shapes_are_those_of_the_unsharded_model_under_any_plan(two, case):
    unsharded = two[case][0]["unsharded"]
    assert unsharded[0], "the unsharded model kept no state: the comparison proves nothing"
    for rank in two[case]:
        assert rank["layout_a"] == unsharded, "plan A"
        assert rank["layout_b"] == unsharded, "plan B"


@pytest.mark.parametrize("case", ["one_rank"])
def test_state_keys_and_shapes_are_those_of_the_unsharded_model_on_one_rank(one, two, case):
    assert one[case][0]["layout"] == two["reshard"][0]["unsharded"], "world size 1"


@pytest.mark.parametrize("case", ["reshard"])
def test_plan_b_really_differs_and_pins_a_fused_table_to_the_fallback(two, case):
    describe = two[case][0]["describe_b"]
    adagrad = [row for row in describe.splitlines() if "| adagrad |" in row]
    assert adagrad and all("fallback" in row and "fallback_tables" in row for row in adagrad), describe


@pytest.mark.parametrize("case", ["reshard"])
def test_a_checkpoint_from_plan_a_continues_in_plan_b_as_if_uninterrupted(two, case):
    """Compared with the uninterrupted torch.optim reference after every step (inside, atol 1e-6)."""
    for rank in two[case]:
        assert rank["step"] == 3
        assert rank["moved"] > 1e-3


@pytest.mark.parametrize("case", ["reshard"])
def test_a_sharded_checkpoint_of_another_optimizer_is_refused_and_changes_nothing(two, case):
    for rank in two[case]:
        refusal = rank["refusal"]
        assert "ebc.embedding_bags.adam.weight" in refusal["message"], refusal
        assert refusal["unchanged"] and refusal["entries"] > 10, refusal


@pytest.mark.parametrize("case", ["one_rank"])
def test_a_two_rank_checkpoint_loads_on_one_rank_and_into_the_unsharded_model(one, case):
    (rank,) = one[case]
    assert rank["unsharded_diff"] <= 1e-6
    assert rank["moved"] > 1e-3


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(HERE / "_resume_job.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)


def _final_weights(directory: Path) -> dict[str, torch.Tensor]:
    """A 2-rank sharded checkpoint, loaded into the unsharded model in this process."""
    model = ManyTableModel(NAMES, seed=5)
    for name, (cls, kwargs) in zip(NAMES, SETTINGS):
        apply_optimizer_in_backward(cls, model.ebc.embedding_bags[name].parameters(), kwargs)
    apply_optimizer_in_backward(DENSE[0], model.dense[0].parameters(), DENSE[1])
    with pytest.warns(UserWarning, match="dense.2"):
        optimizer = get_optimizers(model)
    assert checkpoint.load(directory, model, optimizer)["step"] == 6
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sigkill_of_one_rank_then_resume_gives_bit_identical_weights(tmp_path):
    chooser = random.Random(int.from_bytes(os.urandom(4), "little"))
    kill_rank, kill_step = chooser.choice([0, 1]), chooser.randint(1, 5)
    where = f"(killed rank {kill_rank} at step {kill_step})"
    straight = _torchrun("--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "a_out"), "--steps", "6")
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _torchrun("--ckpt", str(tmp_path / "b"), "--out", str(tmp_path / "b_out"), "--steps", "6",
                       "--kill-rank", str(kill_rank), "--kill-step", str(kill_step))
    assert killed.returncode != 0, f"the job was not killed {where}"
    assert checkpoint.latest(tmp_path / "b").name == f"step-{kill_step:08d}", where
    assert not (tmp_path / "b_out").exists()
    resumed = _torchrun("--ckpt", str(tmp_path / "b"), "--out", str(tmp_path / "b_out"), "--steps", "6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected, got = _final_weights(tmp_path / "a_out"), _final_weights(tmp_path / "b_out")
    start = ManyTableModel(NAMES).state_dict()
    assert all((expected[k] - start[k]).abs().max() > 1e-3 for k in start if not k.startswith("dense.2.")), \
        "training did not move the weights: the comparison proves nothing"
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{key} differs after the resume {where}"


@pytest.mark.parametrize("case", ["state_dict/reshard", "state_dict/reshard/ec"])
def test_load_state_dict_of_another_plan_is_exact(two, case):
    """Plan A's ``state_dict()`` held in memory, loaded into plan B with ``load_state_dict``: every
    table changes its sharding type (row_wise into table_wise, table_row_wise into data_parallel, a
    fused table into the fallback...). On the main of 2026-11-26 this crashed in the DDP hook, or
    refused on one rank while the other loaded."""
    for rank, out in enumerate(two[case]):
        assert out["moved"] > 1e-3, f"rank {rank}: the reference did not move"  # compared after every step


@pytest.mark.parametrize("case", ["state_dict/reshard"])
def test_a_load_that_fails_a_check_on_one_rank_is_refused_on_every_rank_and_changes_nothing(two, case):
    messages = [out["refusal"] for out in two[case]]
    assert "shape mismatch for 'dense.0.weight' state 'exp_avg'" in messages[0], messages
    assert "(found on rank 1)" in messages[0], messages
    assert messages[0] == messages[1], messages
    assert all(out["unchanged"] for out in two[case])


@pytest.mark.parametrize("case", ["state_dict/stock"])
def test_a_stock_torchrec_state_dict_is_refused_alike_on_every_rank(two, case):
    """Plan-dependent keys and state names qualified by a table's: refused, the same error on both ranks (on the main
    of 2026-11-26 one rank raised and the other waited in all_gather_object until its timeout)."""
    errors = [out["error"] for out in two[case]]
    assert errors[0] != "no error" and errors[0] == errors[1], errors
    assert "optimizer state does not match the model" in errors[0] or "differs across ranks" in errors[0], errors
    assert "convert it with sharders.from_torchrec" in errors[0], errors
    assert all(out["unchanged"] for out in two[case])


@pytest.mark.parametrize("case", ["plain_dcp"])
def test_plain_dcp_into_fresh_objects_is_exact_under_either_plan(two, case):
    """Compared with the reference after every step, in the body; here, that each run moved it."""
    for rank, out in enumerate(two[case]):
        for form in ("recipe", "stateful", "unloaded"):
            assert out[form] > 1e-3, f"rank {rank}, {form}: the reference did not move"


@pytest.mark.parametrize("case", ["plain_dcp/same_plan"])
def test_plain_dcp_under_the_same_table_wise_plan_is_exact_with_torchs_default_planner(two, case):
    """Compared with the reference after every step, in the body; here, that each run moved it:
    torch's recipe and the Stateful protocol with torch's default planner, and a checkpoint in the
    layout written before param_groups was one entry, through checkpoint.LoadPlanner."""
    for rank, out in enumerate(two[case]):
        for form in ("recipe", "stateful", "before"):
            assert out[form] > 1e-3, f"rank {rank}, {form}: the reference did not move"


@pytest.mark.parametrize("case", ["plain_dcp/same_plan"])
def test_torchs_get_state_dict_does_not_take_a_distributed_model_parallel(two, case):
    """torch's get_state_dict resolves parameter names by attribute on the model, which DMP's names
    (its wrapper stripped) do not follow: it raises before it reaches the optimizer, for stock
    TorchRec alike (docs/checkpoints.md)."""
    for out in two[case]:
        assert out["get_state_dict"].startswith("AttributeError: 'DistributedModelParallel' object has no attribute")


@pytest.mark.parametrize("case", ["plain_dcp"])
def test_a_state_dict_filled_in_place_and_never_loaded_is_refused_before_anything_trains(two, case):
    for rank, out in enumerate(two[case]):
        assert "was read into opt.state_dict() in place (dcp.load) but never loaded" in out["refusal"], out["refusal"]
        assert "adam" in out["refusal"] and out["unchanged"], (rank, out)


@pytest.mark.parametrize("case", ["state_dict/interrupted"])
def test_a_load_interrupted_half_way_changes_nothing(two, case):
    for rank, out in enumerate(two[case]):
        assert out["third table"] is True and out["MLP"] is True, (rank, out)
        assert out["moved"] > 1e-3, f"rank {rank}: the reference did not move"
