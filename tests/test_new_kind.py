"""A new table kind is its own module and one registry line, in the sharder's ``kinds=`` (2 ranks, gloo).

``tests/_recording_kind.py`` defines a kind that no library module names: a table whose lookups
are recorded and whose weights never change. Its registry line goes to the sharder's ``kinds=``;
the model is then sharded under DMP beside a fused SGD table, and trained.
"""

from __future__ import annotations

import ast
from functools import partial
from pathlib import Path

import pytest

from _recording_kind import recorded_and_unchanged, variable_batch_beside_the_fallback
from _row_kind import clipped_windows_and_a_checkpoint
from overlap_optim.testing import run_cases, selected_cases

ROOT = Path(__file__).resolve().parent.parent
CASES = {t: partial(recorded_and_unchanged, sharding_type=t) for t in ("table_wise", "row_wise")}
CASES["vbe"] = variable_batch_beside_the_fallback
CASES.update({f"row_state_{t}": partial(clipped_windows_and_a_checkpoint, sharding_type=t) for t in ("table_wise", "row_wise")})


@pytest.fixture(scope="module")
def ranks(request):
    return run_cases(CASES, selected_cases(request, CASES), timeout=300)


@pytest.mark.parametrize("case", ["table_wise", "row_wise"])
def test_a_new_kind_records_every_lookup_and_never_updates(ranks, case):
    results = ranks[case]
    sent = sorted(i for r in results for i in r["sent"])
    recorded = sorted(i for r in results for i in r["recorded"])
    assert sent and recorded == sent  # every id each rank looked up reached a recording shard, once
    for result in results:
        assert result["kinds"] == {"recorded": "recording", "trained": "fused"}
        assert result["moved"].get("recorded", 0.0) == 0.0
        assert not result["grads"]
        assert result["describe"] and all("| frozen |" in row for row in result["describe"]), result["describe"]
    assert max(r["moved"].get("trained", 0.0) for r in results) > 1e-3  # the rest of the model trained


@pytest.mark.parametrize("case", ["row_state_table_wise", "row_state_row_wise"])
def test_a_new_kind_with_row_state_is_exact_under_clipping_windows_and_a_checkpoint(ranks, case):
    """tests/_row_kind.py: its module and its kinds= line alone. Against torch.optim on the global batch
    after every step (asserted in the rank body); here: the kind ran, its state was saved, both tables moved."""
    for result in ranks[case]:
        assert result["kinds"] == {"mine": "kind_with_rows", "fused": "fused"}
        assert "ebc.embedding_bags.mine.weight" in result["state"], result["state"]
        assert min(result["moved"].values()) > 1e-3, result["moved"]


def test_no_library_module_names_the_new_kinds():
    """The kinds need nothing of the library but their registry lines (handed to the sharder by the tests)."""
    for package in ("sharders", "overlap_optim"):
        for path in sorted((ROOT / package).glob("*.py")):
            text = path.read_text()
            names = {n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name)}
            assert not {"RecordingTable", "RowStateTable"} & names, path
            assert "kind_with_rows" not in text, path


@pytest.mark.parametrize("case", ["vbe"])
def test_a_variable_batch_reaching_a_new_kind_beside_the_fallback_is_refused_by_name(ranks, case):
    """A kind named by a string (no enum's ``.value``) beside a fallback table: each rank refuses the
    VBE batch naming the new kind's table (on the main of 2026-11-27: AttributeError, 'str' object has
    no attribute 'value', in the check that looks for fused tables beside fallback ones)."""
    errors = [out["error"] for out in ranks[case]]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("NotImplementedError: a batch with a variable batch size per feature (VBE)"), errors[0]
    assert "{'recorded': 'it runs as recording" in errors[0] and "'trained'" not in errors[0], errors[0]
