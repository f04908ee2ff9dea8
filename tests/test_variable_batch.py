"""Batches with a variable batch size per feature (VBE): exact where FBGEMM's fused kernel takes
them (SGD, row-wise Adagrad) and in the fallback (lazy, and cross-shard layer-wise tables), on every
model-parallel sharding type; with ``variable_batch=True`` a table FBGEMM cannot run so goes to
the fallback; refused on every rank alike, naming the table and a route that works, everywhere else
(2 ranks, against torch.optim on the global batch)."""

from __future__ import annotations

from functools import partial

import pytest

from _vbe_bodies import train
from overlap_optim.testing import run_cases, selected_cases
from sharders.refusals import refusal

EXACT = ["sgd/table_wise", "sgd/row_wise", "sgd/column_wise", "rowwise_adagrad/table_wise",
         "rowwise_adagrad/row_wise",
         # the fallback (refused on the main of 2026-11-26: it had no variable-batch lookup)
         "adam/table_wise", "adam/row_wise", "adam/column_wise", "adam/table_row_wise", "lamb/row_wise",
         "adafactor/column_wise",
         # declared: FBGEMM's Adagrad has no variable-batch backward; the fallback runs it
         "adagrad/table_wise/declared", "adagrad/row_wise/declared",
         # two tables at two settings: two fused kernels in one lookup (on the main of 2026-11-27, row_wise:
         # "[TBE API v2] Using pre-allocated vbe_output is not supported on CPU" on both ranks)
         "sgd/row_wise/+sgd", "rowwise_adagrad/row_wise/+sgd", "sgd/column_wise/+sgd", "sgd/table_wise/+sgd"]
REFUSED = {  # case -> what the refusal names (at the first VBE batch)
    "adagrad/table_wise": "FBGEMM's EXACT_ADAGRAD kernel has no variable-batch backward",
    "sgd/data_parallel": "DDP hook",
    # TorchRec's mean divisor of row-split tables reads one batch size: 5e-3 off, or an IndexError
    "sgd/row_wise/mean": "MEAN pooling on a row-split table",
    # an FP16 table fuses where our compiled backward steps it; a VBE batch would take FBGEMM's
    "sgd/table_wise/fp16": "FBGEMM's variable-batch backward rounds the update twice",
}
REFUSED_AT_SHARDING = {"sgd/data_parallel/declared": "torch.optim after all-reduce (DDP hook)"}
# the ranks send different batch sizes: gloo cannot gather TorchRec's row-wise output gradient
UNEVEN = {"sgd/row_wise/uneven": True, "adam/table_row_wise/uneven": True, "sgd/table_wise/uneven": False,
          "adam/column_wise/uneven": False}  # case -> refused


def _case(name: str):
    optimizer, sharding_type, *option = name.split("/")
    split = option[0][1:] if option and option[0].startswith("+") else None  # "+sgd": a second table, under SGD
    return partial(train, optimizer=optimizer, sharding_type=sharding_type, variable_batch=option == ["declared"],
                   uneven=option == ["uneven"], mean=option == ["mean"], fp16=option == ["fp16"], split=split)


CASES = {c: _case(c) for c in [*EXACT, *REFUSED, *REFUSED_AT_SHARDING, *UNEVEN]}


@pytest.fixture(scope="module")
def two(request):
    return run_cases(CASES, selected_cases(request, CASES), timeout=240)


@pytest.mark.parametrize("case", EXACT)
def test_variable_batches_are_exact_on_every_model_parallel_kernel(two, case):
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


@pytest.mark.parametrize("case", REFUSED_AT_SHARDING)
def test_declared_variable_batches_refuse_a_table_no_kernel_runs_so_at_sharding(two, case):
    errors = [out.get("error") for out in two[case]]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert all(out["step"] == "shard" for out in two[case])
    assert "variable_batch=True, and the module '(root)' has tables that no kernel runs exactly" in errors[0], errors[0]
    assert "{'t': " in errors[0] and REFUSED_AT_SHARDING[case] in errors[0]
    assert refusal("variable_batch").matches(errors[0])


@pytest.mark.parametrize("case", UNEVEN)
def test_ranks_that_send_different_batch_sizes_are_refused_alike_on_gloo_for_row_split_tables(two, case):
    """On the main of 2026-11-26: TorchRec's row-wise output reduce-scatter crashed in backward
    (ProcessGroupGloo::allgather: invalid tensor size), fused SGD too. Table-wise and column-wise
    tables take them, exactly."""
    if not UNEVEN[case]:
        for rank, out in enumerate(two[case]):
            assert "error" not in out and max(out["diffs"]) <= 1e-5, f"rank {rank}: {out}"
        return
    errors = [out.get("error") for out in two[case]]
    assert errors[0] is not None and errors[0] == errors[1] and all(o["step"] == 0 for o in two[case]), errors
    assert "{'t': \"row-split, and the ranks send its features different batch sizes {'f': [2, 3], 'g': [3, 2]}" \
        in errors[0], errors[0]
    assert refusal("variable_batch").matches(errors[0])
