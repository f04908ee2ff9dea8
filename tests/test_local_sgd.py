"""Local SGD for the dense part under the Quadratic Synchronization Rule (overlap_optim/local_sgd.py).

Reference: ``_local_sgd_bodies.Simulation``, one process with one replica per rank, each with its own
plain torch.optim optimizer and scheduler, averaging by the rule; itself checked against torch's
``PeriodicModelAverager`` for a constant period. Ours: 2 ranks (gloo), DDP with our hook and
``local_sgd=QSR(...)``. Weights compared after every step on both ranks within 1e-6.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

import overlap_optim
from overlap_optim.testing import run_cases, run_ranks, selected_cases
from _local_sgd_bodies import (CASES, dmp_with_local_sgd, load_on_one_rank, mid_round_checkpoint,
                               ours_against_simulation, simulation_matches_periodic_model_averager)

RANK_CASES = {  # one spawned group
    "averager": simulation_matches_periodic_model_averager,
    **{name: partial(ours_against_simulation, name=name) for name in CASES},
    "resume": mid_round_checkpoint,  # its directory is bound in the fixture
    "dmp": dmp_with_local_sgd,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("local_sgd")


@pytest.fixture(scope="module")
def ranks(request, checkpoints):
    cases = {**RANK_CASES, "resume": partial(mid_round_checkpoint, directory=str(checkpoints))}
    return run_cases(cases, selected_cases(request, RANK_CASES), timeout=300)


@pytest.mark.parametrize("case", ["averager"])
def test_the_simulation_equals_torchs_periodic_model_averager(ranks, case):
    for averager in ranks[case]:
        assert averager["worst"] <= 1e-7 and averager["averaged_at"] == [2, 5, 8], averager


@pytest.mark.parametrize("case", ["sgd_momentum_constant"])
def test_constant_period_sgd_with_momentum(ranks, case):
    for run in ranks[case]:
        assert [t[0] for t in run["trace"]] == [0, 0, 1] * 4  # all-reduces: none on local steps, one to average
        assert {t[1] for t in run["trace"]} == {3}
        assert run["spread"] == 0.0  # the last step averaged: every rank holds the same weights


@pytest.mark.parametrize("case", ["adam_qsr_decaying"])
def test_adam_with_a_decaying_lr_grows_its_period_by_the_rule(ranks, case):
    for run in ranks[case]:
        counts, periods, expected = [t[0] for t in run["trace"]], [t[1] for t in run["trace"]], [t[2] for t in run["trace"]]
        assert periods == expected, (periods, expected)  # set at each round's first step, as the simulation
        assert counts[:2] == [1, 1] and periods[:2] == [0, 0]  # warm-up: synchronous, DDP's all-reduce
        lr_at_2, lr_at_6 = 0.02 * 0.85**2, 0.02 * 0.85**6
        assert periods[2] == max(2, math.floor((0.03 / lr_at_2) ** 2)) == 4
        assert periods[6] == min(max(2, math.floor((0.03 / lr_at_6) ** 2)), 12 - 6) == 6  # capped by total_steps
        assert run["averaged_at"] == [5, 11] and run["spread"] == 0.0  # training ends on an averaging
        assert sum(counts[2:]) == 2  # one all-reduce per averaging, none on the 8 other local steps


@pytest.mark.parametrize("case", ["sgd_period_one"])
def test_period_one_with_alpha_zero_equals_synchronous_training(ranks, case):
    for run in ranks[case]:
        assert run["vs_synchronous"] <= 1e-6, run["vs_synchronous"]
        assert [t[0] for t in run["trace"]] == [1] * 12  # the averaging replaces the gradient all-reduce


def test_qsr_settings_are_checked_where_they_enter():
    for kwargs, message in (({"base_period": 0}, "base_period must be an int >= 1, got 0"),
                            ({"alpha": -0.1}, "alpha must be >= 0, got -0.1"),
                            ({"power": 0}, "power must be > 0, got 0"),
                            ({"average_state": "exp_avg"}, "average_state takes state names")):
        with pytest.raises((ValueError, TypeError), match=message):
            overlap_optim.QSR(**kwargs)


@pytest.mark.parametrize("case", ["resume"])
def test_a_checkpoint_between_averagings_resumes_bit_identically_on_the_same_world_size(ranks, checkpoints, case):
    for out in ranks[case]:
        assert out["saved"]["in_round"] == 1  # taken one step into a round: the ranks differed
        assert out["resume_diff"] == 0.0, out["resume_diff"]
    assert len(list(checkpoints.glob("step-*/local-sgd-rank-*-of-2.pt"))) == 2  # each rank's own
    refusal = run_ranks(load_on_one_rank, str(checkpoints), world_size=1, timeout=120)[0]
    assert "taken between two local-SGD averagings on 2 ranks" in refusal and "not 1" in refusal, refusal


@pytest.mark.parametrize("case", ["dmp"])
def test_dmp_tables_stay_exact_while_the_dense_part_averages_every_round(ranks, case):
    spreads = ranks[case][0]["spreads"]  # compared with the reference after every step, in the ranks
    assert [s == 0.0 for s in spreads] == [False, False, True, False, False, True, False], spreads
