"""Local SGD for the dense part under the Quadratic Synchronization Rule (overlap_optim/local_sgd.py).

Reference: ``_local_sgd_bodies.Simulation``, one process with one replica per rank, each with its own
plain torch.optim optimizer and scheduler, averaging by the rule; itself checked against torch's
``PeriodicModelAverager`` for a constant period. Ours: 2 ranks (gloo), DDP with our hook and
``local_sgd=QSR(...)``. Weights compared after every step on both ranks within 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

import overlap_optim
from overlap_optim.testing import run_ranks
from _local_sgd_bodies import all_checks, load_on_one_rank


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("local_sgd")


@pytest.fixture(scope="module")
def ranks(checkpoints):
    return run_ranks(all_checks, str(checkpoints), timeout=300)


def test_the_simulation_equals_torchs_periodic_model_averager(ranks):
    for rank in ranks:
        assert rank["averager"]["worst"] <= 1e-7 and rank["averager"]["averaged_at"] == [2, 5, 8], rank["averager"]


def test_constant_period_sgd_with_momentum(ranks):
    for rank in ranks:
        run = rank["cases"]["sgd_momentum_constant"]
        assert [t[0] for t in run["trace"]] == [0, 0, 1] * 4  # all-reduces: none on local steps, one to average
        assert {t[1] for t in run["trace"]} == {3}
        assert run["spread"] == 0.0  # the last step averaged: every rank holds the same weights


def test_adam_with_a_decaying_lr_grows_its_period_by_the_rule(ranks):
    for rank in ranks:
        run = rank["cases"]["adam_qsr_decaying"]
        counts, periods, expected = [t[0] for t in run["trace"]], [t[1] for t in run["trace"]], [t[2] for t in run["trace"]]
        assert periods == expected, (periods, expected)  # set at each round's first step, as the simulation
        assert counts[:2] == [1, 1] and periods[:2] == [0, 0]  # warm-up: synchronous, DDP's all-reduce
        lr_at_2, lr_at_6 = 0.02 * 0.85**2, 0.02 * 0.85**6
        assert periods[2] == max(2, math.floor((0.03 / lr_at_2) ** 2)) == 4
        assert periods[6] == min(max(2, math.floor((0.03 / lr_at_6) ** 2)), 12 - 6) == 6  # capped by total_steps
        assert run["averaged_at"] == [5, 11] and run["spread"] == 0.0  # training ends on an averaging
        assert sum(counts[2:]) == 2  # one all-reduce per averaging, none on the 8 other local steps


def test_period_one_with_alpha_zero_equals_synchronous_training(ranks):
    for rank in ranks:
        run = rank["cases"]["sgd_period_one"]
        assert run["vs_synchronous"] <= 1e-6, run["vs_synchronous"]
        assert [t[0] for t in run["trace"]] == [1] * 12  # the averaging replaces the gradient all-reduce


def test_qsr_settings_are_checked_where_they_enter():
    for kwargs, message in (({"base_period": 0}, "base_period must be an int >= 1, got 0"),
                            ({"alpha": -0.1}, "alpha must be >= 0, got -0.1"),
                            ({"power": 0}, "power must be > 0, got 0"),
                            ({"average_state": "exp_avg"}, "average_state takes state names")):
        with pytest.raises((ValueError, TypeError), match=message):
            overlap_optim.QSR(**kwargs)


def test_a_checkpoint_between_averagings_resumes_bit_identically_on_the_same_world_size(ranks, checkpoints):
    for rank in ranks:
        out = rank["resume"]
        assert out["saved"]["in_round"] == 1  # taken one step into a round: the ranks differed
        assert out["resume_diff"] == 0.0, out["resume_diff"]
    assert len(list(checkpoints.glob("step-*/local-sgd-rank-*-of-2.pt"))) == 2  # each rank's own
    refusal = run_ranks(load_on_one_rank, str(checkpoints), world_size=1, timeout=120)[0]
    assert "taken between two local-SGD averagings on 2 ranks" in refusal and "not 1" in refusal, refusal


def test_dmp_tables_stay_exact_while_the_dense_part_averages_every_round(ranks):
    spreads = ranks[0]["dmp"]["spreads"]  # compared with the reference after every step, in the ranks
    assert [s == 0.0 for s in spreads] == [False, False, True, False, False, True, False], spreads
