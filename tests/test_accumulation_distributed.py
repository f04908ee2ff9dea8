"""Gradient accumulation (``overlap_optim.no_step``) on 2 ranks (gloo) against one process on the
global batch: k backward() calls, then one torch.optim step.

The bodies (``_accumulation_bodies``) compare the weights after every window; here each case's
result is checked: exact, the reference moved, the bound clipped; the undeclared loop is stopped
in its second window on both ranks; a mutant that updates at no_step micro-batches is caught.
"""

from __future__ import annotations

from functools import partial

import pytest

from _accumulation_bodies import ddp_windows, qsr_windows, tables_windows, undeclared
from overlap_optim.testing import run_cases, selected_cases

CASES = {
    "ddp_k2": partial(ddp_windows, k=2),
    "ddp_k3": partial(ddp_windows, k=3),
    "ddp_k3_clipped": partial(ddp_windows, k=3, clip=True),
    "ddp_forward_before_the_block": partial(ddp_windows, k=2, forward_before=True),
    "ddp_mutant_updates_every_micro_batch": partial(ddp_windows, k=2, mutate=True),
    "tables_k2": partial(tables_windows, k=2),
    "tables_k3": partial(tables_windows, k=3),
    "tables_thirds": partial(tables_windows, k=2, thirds=True),
    "tables_k3_clipped": partial(tables_windows, k=3, clip=True),
    "tables_mutant_updates_every_micro_batch": partial(tables_windows, k=2, mutate=True),
    "qsr": qsr_windows,
    "undeclared": undeclared,
}


@pytest.fixture(scope="module")
def ranks(request):
    return run_cases(CASES, selected_cases(request, CASES), timeout=400)


@pytest.mark.parametrize("case", ["ddp_k2", "ddp_k3", "ddp_k3_clipped", "ddp_forward_before_the_block"])
def test_windows_equal_one_step_on_the_summed_global_gradient(ranks, case):
    for result in ranks[case]:
        assert max(result["diffs"]) < 1e-6, result["diffs"]
        assert result["moved"] > 1e-3, "the reference did not move"
        for reference, ours in result["norms"]:
            assert abs(reference - ours) <= 1e-5 * reference and reference > result["bound"]


@pytest.mark.parametrize("case", ["tables_k2", "tables_k3", "tables_thirds", "tables_k3_clipped"])
def test_every_kind_of_table_kernel_steps_once_per_window(ranks, case):
    for result in ranks[case]:  # the body compared every weight after every window
        still = [n for n, moved in result["moved"].items() if moved < 1e-3]
        assert not still, f"the reference did not move {still}"
        assert set(result["kinds"].values()) == {"fused", "lazy", "dense", "cross_shard", "data_parallel"}
        for reference, ours in result["norms"]:
            assert abs(reference - ours) <= 1e-5 * reference and reference > result["bound"]


def test_an_update_at_a_no_step_micro_batch_is_caught(ranks):
    for result in ranks["ddp_mutant_updates_every_micro_batch"]:
        assert max(result["diffs"]) > 1e-3, result["diffs"]
    for result in ranks["tables_mutant_updates_every_micro_batch"]:
        assert result["worst"] > 1e-3, result


def test_undeclared_accumulation_is_stopped_in_its_second_window_on_every_rank(ranks):
    for stopped in ranks["undeclared"]:
        assert stopped is not None, "the undeclared loop trained to the end"
        window, micro, message = stopped
        assert (window, micro) == (1, 1)
        assert "overlap_optim.no_step(model)" in message and "step() after every backward" in message


def test_local_sgd_counts_one_step_per_window(ranks):
    for result in ranks["qsr"]:
        assert result["steps"] == 4, result
        spread = result["spread_after"]  # local steps 1, 2; averaged at 3; local again at 4
        assert spread[0] > 1e-4 and spread[1] > 1e-4 and spread[2] < 1e-7 and spread[3] > 1e-4, spread
