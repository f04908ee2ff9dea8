"""Our lazy semantics are torch's sparse optimizers' semantics (2 ranks, gloo).

Sharded: one EmbeddingBagCollection on table_wise and on row_wise, one table per case, each
rank fed its own local batch. Reference: the same model unsharded, its tables made sparse
(``nn.EmbeddingBag.sparse = True``, so backward gives sparse COO gradients), stepped by torch's
own sparse-capable optimizers on the concatenated global batch. Every global batch touches a
third of each table's rows (different rows each step, ids repeated within it); one step
touches only the first half of the rows (one row_wise shard idle) and one gives two tables no
ids at all. Weights are compared after every step, within 2e-5:

* Adam (our fallback kernel) == ``torch.optim.SparseAdam``. SparseAdam puts eps outside the
  bias correction: its update is ``lr*sqrt(bc2)/bc1 * m/(sqrt(v)+eps)``, Adam's is
  ``lr/bc1 * m/(sqrt(v)/sqrt(bc2)+eps)`` = ``lr*sqrt(bc2)/bc1 * m/(sqrt(v)+eps*sqrt(bc2))``.
  So at eps=1e-12 they agree; at the default eps=1e-8 plain SparseAdam differs measurably,
  and SparseAdam with eps set to ``eps*sqrt(1-beta2**t)`` before step t agrees.
* Adagrad with lr_decay (fallback) == ``torch.optim.Adagrad`` on sparse gradients.
* SGD (fused FBGEMM kernel, and pinned to the fallback) == ``torch.optim.SGD`` on sparse gradients.

Adam runs in the compiled one pass (``overlap_optim.row_pass``) where it is built; the case
``table_wise/no_extension`` runs it as where it is not, and is held to the same reference.

Rows a batch leaves untouched keep their weights exactly (ours and the reference's), and the
per-table step counter advances on every step, touched or not, as torch's does. Mutation
check: torch.optim.Adam on dense gradients (dense semantics) differs by far more than the
tolerance, so this comparison would catch a dense implementation.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from overlap_optim.testing import run_cases, selected_cases
from _lazy_bodies import ADAM_TABLES, EMPTY_STEP, EMPTY_TABLES, HALF_ONLY_STEP, NAMES, STEPS, TOUCHED, lazy_run

SHARDING_TYPES = ("table_wise", "row_wise")
TOL = 2e-5
# Plain SparseAdam at eps=1e-8 against ours: measured 9.7e-4 (both sharding types, max over
# ranks and steps); pinned with a 5x margin, and far below a structural difference.
PLAIN_SPARSE_ADAM_AT_LEAST, PLAIN_SPARSE_ADAM_AT_MOST = 2e-4, 5e-3
# torch.optim.Adam (dense) against ours, max over ranks: measured 5.9e-2 after 3 steps on both
# Adam tables and sharding types (9.8e-2 / 1.2e-1 after 6). Pinned at 1e-2: 500x the tolerance.
DENSE_ADAM_AT_LEAST = 1e-2


RANK_CASES = {st: partial(lazy_run, sharding_type=st) for st in SHARDING_TYPES}  # one spawned group
RANK_CASES["table_wise/no_extension"] = partial(lazy_run, sharding_type="table_wise", one_pass=False)
ALL_CASES = tuple(RANK_CASES)


@pytest.fixture(scope="module")
def results(request):
    return run_cases(RANK_CASES, selected_cases(request, RANK_CASES), timeout=300)


def _worst(results, sharding_type, key, name, steps=range(STEPS)):
    return max(out["steps"][s][key][name] for out in results[sharding_type] for s in steps)


def test_sparse_adam_with_rescaled_eps_is_adam():
    """The eps relation, single process, on gradients small enough that eps matters."""
    torch.manual_seed(0)
    start, eps, beta2 = torch.randn(6, 3), 1e-8, 0.999
    adam_w, plain_w, rescaled_w = (torch.nn.Parameter(start.clone()) for _ in range(3))
    adam = torch.optim.Adam([adam_w], lr=0.05, eps=eps)
    plain = torch.optim.SparseAdam([plain_w], lr=0.05, eps=eps)
    rescaled = torch.optim.SparseAdam([rescaled_w], lr=0.05, eps=eps)
    for t in range(1, 6):
        grad = torch.randn(6, 3) * 1e-4
        adam_w.grad, plain_w.grad, rescaled_w.grad = grad.clone(), grad.to_sparse(), grad.to_sparse()
        rescaled.param_groups[0]["eps"] = eps * math.sqrt(1 - beta2**t)
        for opt in (adam, plain, rescaled):
            opt.step()
        assert (adam_w - rescaled_w).abs().max().item() <= 1e-6, t
        assert (adam_w - plain_w).abs().max().item() >= 1e-3, t  # measured 2.1e-3 .. 2.7e-3


@pytest.mark.parametrize("case", ALL_CASES)
def test_kernels_and_gradient_layouts_are_the_ones_under_test(results, case):
    from overlap_optim import row_pass

    expected = {"adam_eps_tiny": "fallback", "adam": "fallback", "adagrad_lr_decay": "fallback",
                "sgd_fused": "fused", "sgd_fallback": "fallback"}
    one_pass = sorted(ADAM_TABLES) if row_pass.available() and not case.endswith("no_extension") else []
    for out in results[case]:
        assert out["kernels"] == {n: (k, "lazy") for n, k in expected.items()}, case
        assert set(out["layouts"].values()) == {"torch.sparse_coo"}, out["layouts"]
        assert {n: out["dense_layouts"][n] for n in ADAM_TABLES} == dict.fromkeys(ADAM_TABLES, "torch.strided")
    held = sorted({n for out in results[case] for n in out["one_pass"]})  # each rank names the tables it holds
    assert held == one_pass, held  # only Adam has the compiled pass


@pytest.mark.parametrize("case", ALL_CASES)
def test_batches_touch_a_third_of_the_rows_and_untouched_rows_keep_their_weights(results, case):
    for out in results[case]:
        seen = {n: set() for n in NAMES}
        for step, record in enumerate(out["steps"]):
            for name in NAMES:
                rows = record["rows"][name]
                seen[name].update(rows)
                empty = step == EMPTY_STEP and name in EMPTY_TABLES
                assert len(rows) == (0 if empty else TOUCHED), (case, step, name)
                if not empty:  # the reference moved every step, on the touched rows only
                    assert record["ref_touched_moved"][name] > 1e-3, (case, step, name)
            assert not record["ref_untouched_moved"], (case, step, record["ref_untouched_moved"])
            assert not record["ours_untouched_moved"], (case, step, record["ours_untouched_moved"])
        assert all(len(rows) > TOUCHED for rows in seen.values()), "different rows across steps"
        assert min(out["moved"].values()) > 2e-2, out["moved"]


@pytest.mark.parametrize("case", ["row_wise"])
def test_a_row_wise_shard_sits_idle_when_the_batch_touches_only_the_other(results, case):
    """At HALF_ONLY_STEP one rank's shard of every table is idle, the other's is not."""
    idle = [[r["steps"][HALF_ONLY_STEP]["local_touched"][n] for r in results[case]] for n in NAMES]
    assert all(sorted(counts) == [0, TOUCHED] for counts in idle), idle


@pytest.mark.parametrize("case", ALL_CASES)
@pytest.mark.parametrize("name", NAMES)
def test_matches_torch_sparse_optimizer_after_every_step(results, case, name):
    worst = _worst(results, case, "diff", name)
    assert worst <= TOL, f"{case}/{name}: max diff {worst:.3g} from torch's sparse optimizer"


@pytest.mark.parametrize("case", SHARDING_TYPES)
def test_plain_sparse_adam_at_default_eps_differs_by_its_eps_placement(results, case):
    worst = _worst(results, case, "plain_diff", "adam")
    assert PLAIN_SPARSE_ADAM_AT_LEAST <= worst <= PLAIN_SPARSE_ADAM_AT_MOST, f"{case}: {worst:.3g}"


@pytest.mark.parametrize("case", ALL_CASES)
@pytest.mark.parametrize("name", ADAM_TABLES)
def test_dense_adam_differs_so_a_dense_implementation_would_fail(results, case, name):
    first = _worst(results, case, "dense_diff", name, steps=[0])
    assert first <= TOL, f"{case}/{name}: no state yet, dense and lazy agree on step 1 ({first:.3g})"
    after_3 = _worst(results, case, "dense_diff", name, steps=[2])
    assert after_3 >= DENSE_ADAM_AT_LEAST, f"{case}/{name}: dense Adam only {after_3:.3g} away"
