"""Batches with a variable batch size per feature (VBE): exact where FBGEMM's fused kernel takes
them (SGD, row-wise Adagrad), refused on every rank alike, naming the table and a route that works,
everywhere else (2 ranks, against torch.optim on the global batch)."""

from __future__ import annotations

from functools import partial

import pytest

from _vbe_bodies import train
from overlap_optim.testing import run_cases, selected_cases
from sharders.refusals import refusal

EXACT = ["sgd/table_wise", "sgd/row_wise", "sgd/column_wise", "rowwise_adagrad/table_wise",
         "rowwise_adagrad/row_wise"]
REFUSED = {  # case -> what the refusal names
    "adagrad/table_wise": "FBGEMM's EXACT_ADAGRAD kernel has no variable-batch backward",
    "adam/row_wise": "fallback: torch.optim on touched rows",
    "sgd/data_parallel": "DDP hook",
}
CASES = {c: partial(train, optimizer=c.split("/")[0], sharding_type=c.split("/")[1]) for c in [*EXACT, *REFUSED]}


@pytest.fixture(scope="module")
def two(request):
    return run_cases(CASES, selected_cases(request, CASES), timeout=240)


@pytest.mark.parametrize("case", EXACT)
def test_variable_batches_are_exact_where_fbgemm_takes_them(two, case):
    for rank, out in enumerate(two[case]):
        assert "error" not in out, f"rank {rank}: {out}"
        assert max(out["diffs"]) <= 1e-5, f"rank {rank}: {out['diffs']}"
    assert two[case][0]["moved"] > 1e-3


@pytest.mark.parametrize("case", REFUSED)
def test_variable_batches_are_refused_alike_on_every_rank_elsewhere(two, case):
    # On the main of 2026-11-26: FBGEMM's assertion, or a refusal on the rank that held the table while
    # the other died in the all-to-all.
    errors = [out.get("error") for out in two[case]]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert all(out["step"] == 0 for out in two[case])
    assert "variable batch size per feature (VBE) reached tables that cannot take it: {'t':" in errors[0]
    assert REFUSED[case] in errors[0] and "RowWiseAdagrad" in errors[0]
    assert refusal("variable_batch").matches(errors[0])  # as docs/refusals.md lists it
