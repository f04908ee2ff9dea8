"""2D sparse parallelism (TorchRec's ``DMPCollection``) is refused by name on every rank before anything
is sharded (2 ranks, gloo; DMPCollection's CUDA assert lifted by the test-only stand-in of
``tests/_two_dimensional_bodies.py``; run on CPU only).

On the main of 2026-11-27, with that assert lifted, fallback tables trained silently wrong: ``sync()``
averages only FBGEMM's kernels and their ``sum`` state, so Adam tables were never averaged.
"""

from __future__ import annotations

from functools import partial

import pytest

from _two_dimensional_bodies import cpu_dmp_collection, refused
from overlap_optim.testing import run_cases, selected_cases
from sharders.refusals import refusal

CASES = {"sharders": refused, "wrapper": partial(refused, wrapper_only=True)}


@pytest.fixture(scope="module")
def ranks(request):
    return run_cases(CASES, selected_cases(request, CASES), timeout=240)


@pytest.mark.parametrize("case", CASES)
def test_dmp_collection_is_refused_by_name_on_every_rank_before_anything_is_sharded(ranks, case):
    errors = [out["error"] for out in ranks[case]]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("NotImplementedError: 2D sparse parallelism (DMPCollection: sharding groups of 1 "
                                "of 2 ranks)"), errors[0]
    assert refusal("two_dimensional").matches(errors[0])
    assert all(out["sharded"] == [] for out in ranks[case])


def test_the_cpu_stand_in_lifts_only_the_device_assert():
    import torchrec.distributed.model_parallel as model_parallel

    stand_in = cpu_dmp_collection()
    assert issubclass(stand_in, model_parallel.DMPCollection)
    def asserts_cuda(init) -> bool:
        return any(isinstance(c, str) and "only supports CUDA or MTIA" in c for c in init.__code__.co_consts)

    assert asserts_cuda(model_parallel.DMPCollection.__init__) and not asserts_cuda(stand_in.__init__)
