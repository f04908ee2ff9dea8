"""Dense in-backward optimizers from DDP's comm hook, against plain DDP + torch.optim (2 ranks, gloo).

Every rank trains on different data. Parameters are compared after every step.
"""

from __future__ import annotations

import pytest

from _ddp_checks import CASES, CHECKS
from overlap_optim.testing import run_cases, selected_cases

EXACT = 1e-6


@pytest.fixture(scope="module")
def results(request):
    return run_cases(CHECKS, selected_cases(request, CHECKS), timeout=600)


@pytest.mark.parametrize("case", [*CASES, "multi_bucket", "unannotated_bias", "accumulate_3", "scheduled",
                                  "reannotated"])
def test_matches_plain_ddp_and_torch_optim_every_step(results, case):
    for outcome in results[case]:
        assert max(outcome["diffs"]) <= EXACT, outcome["diffs"]
        assert outcome["moved"] > 1e-3, "the reference did not move"
        assert outcome["grads_none"], "an annotated parameter kept its .grad after backward"


@pytest.mark.parametrize("case", ["reannotated"])
def test_annotating_a_parameter_the_hook_runs_is_refused_and_changes_nothing(results, case):
    for outcome in results[case]:
        assert len(outcome["refusals"]) == 3, outcome["refusals"]
        assert all("already run by overlap_optim's DDP hook" in message for message in outcome["refusals"])


@pytest.mark.parametrize("case", ["unannotated_bias"])
def test_unannotated_parameters_keep_their_averaged_gradient(results, case):
    assert all(outcome["user_grad_ok"] for outcome in results[case])


@pytest.mark.parametrize("case", ["buckets_seen"])
def test_small_buckets_really_split_the_model(results, case):
    assert results[case][0] > 1


@pytest.mark.parametrize("case", ["fp16", "bf16"])
def test_compressed_reduce_stays_within_its_precision_and_is_really_compressed(results, case):
    for outcome in results[case]:
        diffs = outcome["diffs"]
        assert max(diffs) <= 1e-3, diffs
        assert max(diffs) > EXACT, "no difference from the uncompressed reference: nothing was compressed"
