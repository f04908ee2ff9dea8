"""The optional compiled library (overlap_optim.compiled): that it is built where it can be,
and its step-counter operator against torch's own foreach add (the one pass has
tests/test_row_pass.py)."""

from __future__ import annotations

import shutil
import sysconfig

import pytest
import torch

from overlap_optim import compiled, virtual_groups

needs_library = pytest.mark.skipif(not compiled.available(), reason="not built here (no C++ compiler at install)")


def test_the_library_is_built_where_a_compiler_is():
    compiler = (sysconfig.get_config_var("CXX") or "c++").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) on this machine: the library is optional")
    assert compiled.available(), "make builds overlap_optim/_compiled with the C++ compiler; see setup.py"
    assert compiled.op("adam_rows_") is not None and compiled.op("add_one_") is not None


@needs_library
def test_add_one_is_torchs_foreach_add_bitwise():
    """Counters from 0 to past 2**24, where a float32 + 1 no longer changes the value."""
    values = [0.0, 1.0, 41.0, 2.0**24 - 1, 2.0**24, 3.5]
    ours = [torch.tensor(v) for v in values]
    theirs = [torch.tensor(v) for v in values]
    versions = [t._version for t in ours]
    assert compiled.op("add_one_")(ours)
    torch._foreach_add_(theirs, 1)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), (ours, theirs)
    assert ours[4].item() == 2.0**24  # the float32 rounding, as torch's
    assert all(t._version > v for t, v in zip(ours, versions))  # an in-place change, as autograd counts them


@needs_library
@pytest.mark.parametrize("odd", ["float64", "two elements", "requires grad"])
def test_add_one_refuses_a_list_with_any_other_counter_and_changes_none(odd):
    other = {"float64": torch.tensor(1.0, dtype=torch.float64), "two elements": torch.zeros(2),
             "requires grad": torch.tensor(1.0, requires_grad=True)}[odd]
    counters = [torch.tensor(3.0), other]
    before = [c.detach().clone() for c in counters]
    assert not compiled.op("add_one_")(counters)
    assert all(torch.equal(c.detach(), b) for c, b in zip(counters, before))


@pytest.mark.parametrize("path", ["compiled", "foreach"])
def test_step_counters_advance_as_torch_makes_and_advances_them(path, monkeypatch):
    if path == "compiled" and not compiled.available():
        pytest.skip("not built here (no C++ compiler at install)")
    if path == "foreach":
        monkeypatch.setattr(virtual_groups, "_ADD_ONE", None)
    states = [{}, {"step": torch.tensor(4.0)}, {"step": torch.tensor(7.0, dtype=torch.float64)}]
    counters = virtual_groups.step_counters(states)
    assert [float(c) for c in counters] == [1.0, 5.0, 8.0]  # a float64 counter: torch's own add for all
    assert states[0]["step"].dtype == torch.float32 and states[0]["step"].dim() == 0
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.ones(2)
    torch_opt = torch.optim.Adam([param])
    torch_opt.step()
    made = torch_opt.state[param]["step"]
    assert (made.dtype, made.shape, float(made)) == (states[0]["step"].dtype, states[0]["step"].shape, 1.0)
