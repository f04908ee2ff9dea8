"""sharders.from_torchrec: a stock TorchRec fused-optimizer state dict, converted and trained on (2 ranks, gloo)."""

from __future__ import annotations

from functools import partial

import re

import pytest

from _stock_checkpoint_bodies import continue_from_stock, refused
from overlap_optim.testing import run_cases, selected_cases

CASES = {
    "fused_params": partial(continue_from_stock, source="fused_params"),
    "fused_params/other_plan": partial(continue_from_stock, source="fused_params", other_plan=True),
    "annotations": partial(continue_from_stock, source="annotations"),
    "annotations/other_plan": partial(continue_from_stock, source="annotations", other_plan=True),
    "ec/fused_params": partial(continue_from_stock, source="fused_params", family="ec"),
    "ec/annotations/other_plan": partial(continue_from_stock, source="annotations", family="ec", other_plan=True),
    "refused": refused,
}
CONTINUED = [c for c in CASES if c != "refused"]
ATOL = 1e-5


@pytest.fixture(scope="module")
def ranks(request):
    return run_cases(CASES, selected_cases(request, CASES), timeout=600)


@pytest.mark.parametrize("case", CONTINUED)
def test_stock_is_exact_before_the_conversion(ranks, case):
    """The premise: stock TorchRec matched torch.optim while it trained (so "ours matches stock" means exact)."""
    for rank, out in enumerate(ranks[case]):
        assert max(out["stock_before"]) <= ATOL, f"rank {rank}: stock {max(out['stock_before']):.3g} from torch.optim"


@pytest.mark.parametrize("case", CONTINUED)
def test_ours_continues_from_stock_state_as_torch_optim_and_stock_do(ranks, case):
    """After every step of ours: within ATOL of one process of torch.optim and of stock going on."""
    for rank, out in enumerate(ranks[case]):
        assert len(out["ours"]) >= 4, out
        assert max(out["ours"]) <= ATOL, f"rank {rank}: ours {out['ours']} from torch.optim"
        assert max(out["stock"]) <= ATOL, f"rank {rank}: stock {out['stock']} from torch.optim"
        assert max(out["ours_vs_stock"]) <= ATOL, f"rank {rank}: ours {out['ours_vs_stock']} from stock"


@pytest.mark.parametrize("case", CONTINUED)
def test_the_reference_moves_after_the_conversion(ranks, case):
    moved = ranks[case][0]["moved"]
    assert sorted(moved) == ["adagrad", "rowwise", "sgd"], moved
    assert min(moved.values()) > 100 * ATOL, moved


@pytest.mark.parametrize("case", CONTINUED)
def test_converted_tables_get_the_given_step(ranks, case):
    steps = ranks[case][0]["step"]
    assert steps and set(steps) == {3.0}, steps


def test_mismatched_settings_are_refused_by_table_and_setting_on_both_ranks(ranks):
    first, second = ranks["refused"]
    assert first["keys"] != second["keys"], "table_wise: each rank's stock dict holds other tables"
    message = first["settings"]
    assert message == second["settings"]
    assert message.startswith("ValueError"), message
    assert "table 'eps': eps is 1e-10 here, 1e-08 (FBGEMM's default" in message, message
    assert "table 'other'" in message and "EXACT_ROWWISE_ADAGRAD" in message and "Adagrad" in message, message
    assert "'sgd'" not in message, message  # SGD on both sides: converted (no state)


@pytest.mark.parametrize("what, match", [
    ("one_rank", r"TypeError: .*is a str, not a tensor \(found on rank 1\)"),
    ("no_settings", r"ValueError: .*table 'eps': no stock settings"),
    ("bad_step", r"ValueError: step must be a non-negative int, got -1"),
    ("not_a_dict", r"TypeError: from_torchrec takes stock TorchRec's fused_optimizer.state_dict\(\).*got list"),
    ("unsupported", r"ValueError: .*table 'eps': FBGEMM's ADAM has no exact.*'other'.*table 'sgd': FBGEMM's ADAM"),
    ("weight_decay", r"ValueError: .*table 'eps': stock weight_decay=0.01.*table 'sgd': stock weight_decay=0.01"),
])
def test_bad_input_is_refused_alike_on_both_ranks(ranks, what, match):
    first, second = ranks["refused"]
    assert first[what] == second[what]
    assert re.match(match, first[what], flags=re.S), first[what]


def test_a_refusal_changes_nothing_and_the_matching_model_loads(ranks):
    for rank, out in enumerate(ranks["refused"]):
        assert out["unchanged"] == [True, True], f"rank {rank}"
        assert min(out["entries"]) > 0
        assert out["matching"] == "no error", f"rank {rank}: {out['matching']}"


def test_the_old_place_of_the_converter_names_its_new_one():
    """``from_torchrec`` moved to ``sharders`` (the core knows no kernel's state names)."""
    from overlap_optim import checkpoint

    with pytest.raises(AttributeError, match=r"use sharders\.from_torchrec \(docs/migration\.md\)"):
        checkpoint.from_torchrec  # noqa: B018
