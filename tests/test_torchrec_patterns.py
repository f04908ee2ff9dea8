"""TorchRec users' own patterns, each against plain torch.optim on the unsharded model (2 ranks, gloo).

- TorchRec's ``CombinedOptimizer([model.fused_optimizer, KeyedOptimizerWrapper(in_backward_optimizer_filter
  (...), SGD)])`` over fused, fallback, data-parallel and unannotated tables, on every sharding type:
  no duplicate key, the user's optimizer gets exactly the unannotated parameters, weights equal
  after every step.
- A model built wholly on the meta device, dense part included: DMP's ``init_parameters``
  replaces every parameter and the annotations follow them.
- ``dense_tables``: batches that touch only some rows; equal to torch.optim on dense tables.
"""

from __future__ import annotations

import pytest

from overlap_optim.testing import run_ranks
from _sharded_parity import SHARDING_TYPES
from _torchrec_patterns import patterns

UNANNOTATED = ["dense.2.bias", "dense.2.weight", "ebc.embedding_bags.plain.weight"]


@pytest.fixture(scope="module")
def results():
    return run_ranks(patterns, timeout=600)


def _still(moved):
    return [n for n, d in moved.items() if d < 1e-3]


@pytest.mark.parametrize("sharding_type", SHARDING_TYPES)
def test_torchrecs_combined_optimizer_pattern_trains_exactly(results, sharding_type):
    for rank in results:  # weights compared with torch.optim after every step, inside the ranks
        run = rank["combined"][sharding_type]
        assert run["user_keys"] == UNANNOTATED
        assert not _still(run["moved"]), f"the reference did not move {_still(run['moved'])}"


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise"])
def test_a_model_built_on_meta_keeps_every_annotation_through_dmp(results, sharding_type):
    for rank in results:
        run = rank["meta"][sharding_type]
        assert run["user_keys"] == UNANNOTATED  # dense.0 annotated on meta: not handed to the user
        assert not _still(run["moved"])


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "column_wise"])
def test_dense_tables_equal_torch_optim_on_partial_batches(results, sharding_type):
    run = results[0]["dense_tables"][sharding_type]
    assert all(n > 0 for n in run["untouched"]), run["untouched"]  # lazy would differ on these rows
    assert not _still(run["moved"])
    assert {(table, kernel, semantics) for table, kernel, semantics in run["decisions"]} == {
        (t, "fallback", "dense") for t in ("adam", "adagrad", "momentum")
    }
