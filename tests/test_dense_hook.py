"""Dense in-backward optimizers from DDP's comm hook, against plain DDP + torch.optim (2 ranks, gloo).

Every rank trains on different data. Parameters are compared after every step.
"""

from __future__ import annotations

import pytest

from _ddp_checks import CASES, all_checks
from overlap_optim.testing import run_ranks

EXACT = 1e-6


@pytest.fixture(scope="module")
def results():
    return run_ranks(all_checks, timeout=600)


@pytest.mark.parametrize("case", [*CASES, "multi_bucket", "unannotated_bias", "accumulate_3", "scheduled"])
def test_matches_plain_ddp_and_torch_optim_every_step(results, case):
    for rank in results:
        outcome = rank[case]
        assert max(outcome["diffs"]) <= EXACT, outcome["diffs"]
        assert outcome["moved"] > 1e-3, "the reference did not move"
        assert outcome["grads_none"], "an annotated parameter kept its .grad after backward"


def test_unannotated_parameters_keep_their_averaged_gradient(results):
    assert all(rank["unannotated_bias"]["user_grad_ok"] for rank in results)


def test_small_buckets_really_split_the_model(results):
    assert results[0]["buckets_seen"] > 1


@pytest.mark.parametrize("comm", ["fp16", "bf16"])
def test_compressed_reduce_stays_within_its_precision_and_is_really_compressed(results, comm):
    for rank in results:
        diffs = rank[comm]["diffs"]
        assert max(diffs) <= 1e-3, diffs
        assert max(diffs) > EXACT, "no difference from the uncompressed reference: nothing was compressed"
