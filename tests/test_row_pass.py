"""The compiled one-pass update of touched rows (overlap_optim.row_pass), and the path without it.

Every check runs on both paths: ``one_pass`` (the extension, where it is built) and
``no_extension`` (as where no C++ compiler was at hand: gather, torch.optim's step, scatter).
The reference is torch.optim's own Adam/AdamW (its default single-tensor path) on the whole
table, with every row touched at every step, so lazy and dense agree; the lazy rule on
partial batches is held to torch.optim.SparseAdam in tests/test_lazy_reference.py.
"""

from __future__ import annotations

import pytest
import torch

from overlap_optim import row_pass
from overlap_optim.spec import AnnotationGroup, describe_optimizer
from overlap_optim.table_optimizer import RowOptimizer

SETTINGS = {
    "adam": (torch.optim.Adam, {"lr": 0.05}),
    "adam/l2+amsgrad": (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True}),
    "adam/maximize+low_betas": (torch.optim.Adam, {"lr": 0.05, "betas": (0.3, 0.6), "maximize": True}),
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    "adamw/amsgrad+eps": (torch.optim.AdamW, {"lr": 0.05, "amsgrad": True, "eps": 1e-3}),
}
PATHS = ["one_pass", "no_extension"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "one_pass" and not row_pass.available():
        pytest.skip("the extension is not built here (no C++ compiler at install): only the other path runs")
    if request.param == "no_extension":
        monkeypatch.setattr(row_pass, "_ADAM_ROWS", None)
    return request.param


def _rows(weight, cls, kwargs, path) -> RowOptimizer:
    rows = RowOptimizer(weight, AnnotationGroup(describe_optimizer(cls, kwargs)), "t")
    assert rows.one_pass == (path == "one_pass")
    return rows


def _repeated_ids(rows: int, generator: torch.Generator) -> torch.Tensor:
    """Every row at least once, some two or three times, in a random order."""
    ids = torch.cat([torch.arange(rows), torch.randint(0, rows, (rows,), generator=generator)])
    return ids[torch.randperm(ids.numel(), generator=generator)]


@pytest.mark.parametrize("name", SETTINGS)
def test_repeated_ids_are_summed_and_match_torch_optim_every_step(path, name):
    cls, kwargs = SETTINGS[name]
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 7, generator=generator)
    start = weight.clone()
    reference = torch.nn.Parameter(weight.clone())
    rows, torch_opt = _rows(weight, cls, kwargs, path), cls([reference], **kwargs)
    schedule = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda step: 0.5**step)
    for step in range(5):
        ids = _repeated_ids(40, generator)
        grads = torch.randn(ids.numel(), 7, generator=generator)
        rows.step(ids, grads) if rows.one_pass else rows.step(*_summed(ids, grads))
        reference.grad = torch.zeros(40, 7).index_add_(0, ids, grads)
        torch_opt.step()
        schedule.step()
        rows.param_group["lr"] = torch_opt.param_groups[0]["lr"]  # the scheduler's lr reaches our next step
        torch.testing.assert_close(weight, reference.detach(), rtol=1e-5, atol=1e-6, msg=f"{name}, step {step}")
        theirs = torch_opt.state[reference]
        assert set(rows.state) == set(theirs), (rows.state.keys(), theirs.keys())
        for key, value in theirs.items():
            torch.testing.assert_close(rows.state[key], value, rtol=1e-5, atol=1e-7, msg=f"{name}: {key}")
    assert (reference.detach() - start).abs().min() > 0, "the reference did not move every row"


def _summed(ids, grads):
    """What the fallback gives a table without the one pass: unique ids, summed gradients."""
    from overlap_optim.table_optimizer import sum_rows

    return sum_rows(ids, grads)


def test_a_tensor_lr_and_an_empty_batch_step_as_torch_does(path):
    """A tensor lr (torch.optim accepts one); a batch with no rows advances the step counter
    and changes no weight, as SparseAdam on an empty gradient does."""
    torch.manual_seed(0)
    weight = torch.randn(6, 4)
    reference = torch.nn.Parameter(weight.clone())
    rows = _rows(weight, torch.optim.Adam, {"lr": torch.tensor(0.1)}, path)
    torch_opt = torch.optim.Adam([reference], lr=torch.tensor(0.1))
    grad = torch.randn(6, 4)
    rows.step(torch.arange(6), grad)
    reference.grad = grad
    torch_opt.step()
    torch.testing.assert_close(weight, reference.detach())
    before = weight.clone()
    rows.step(torch.empty(0, dtype=torch.long), torch.empty(0, 4))
    assert torch.equal(weight, before)
    assert float(rows.table_state["step"]) == 2.0


def test_state_not_laid_out_for_the_kernel_takes_the_other_path_and_stays_exact(path):
    """A loaded moment that is not contiguous (a transposed copy, say) is stepped by the
    gather-step-scatter path, with the same result, repeated ids included."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 3, generator=generator)
    reference = torch.nn.Parameter(weight.clone())
    rows = _rows(weight, torch.optim.Adam, {"lr": 0.1}, path)
    torch_opt = torch.optim.Adam([reference], lr=0.1)
    for step in range(3):
        ids = _repeated_ids(8, generator)
        grads = torch.randn(ids.numel(), 3, generator=generator)
        if step == 1:
            state = {k: (v.t().contiguous().t() if k != "step" else v) for k, v in rows.state.items()}
            assert not state["exp_avg"].is_contiguous()
            rows.load_state(state)
        rows.step(ids, grads) if rows.one_pass else rows.step(*_summed(ids, grads))
        reference.grad = torch.zeros(8, 3).index_add_(0, ids, grads)
        torch_opt.step()
        torch.testing.assert_close(weight, reference.detach(), msg=f"step {step}")


def test_an_id_outside_the_table_is_refused_not_written(path):
    weight = torch.zeros(4, 2)
    rows = _rows(weight, torch.optim.Adam, {"lr": 0.1}, path)
    with pytest.raises((RuntimeError, IndexError), match="out of range|index"):
        rows.step(torch.tensor([1, 4]), torch.ones(2, 2))
    assert torch.equal(weight, torch.zeros(4, 2))


@pytest.mark.skipif(not row_pass.available(), reason="the extension is not built here (no C++ compiler)")
def test_one_pass_is_bitwise_the_same_on_one_thread_and_two():
    """Each row is summed and stepped by one thread, in a fixed order: the result does not
    depend on the thread count (so ranks with different pools agree)."""
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            generator = torch.Generator().manual_seed(3)
            weight = torch.randn(5000, 16, generator=generator)
            rows = _rows(weight, torch.optim.Adam, {"lr": 0.01}, "one_pass")
            for _ in range(3):
                ids = torch.randint(0, 5000, (8000,), generator=generator)
                rows.step(ids, torch.randn(8000, 16, generator=generator))
            results.append(weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
