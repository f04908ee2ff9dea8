"""overlap_optim/lost.py under torch.compile, one process (a gloo group of one).

The watch on torch's own ``fully_shard`` is torch's global forward pre-hook (2-rank tests of the
refusal itself: tests/test_fsdp.py, tests/test_tensor_parallel.py). Inside a compiled region it
must neither break a graph of modules that are not FSDP's nor be traced: tracing its check crashed
dynamo in the first forward of a model sharded by ``overlap_optim.fully_shard``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import overlap_optim


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


def _annotated() -> nn.Sequential:
    model = _mlp()
    overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.1})
    return model


def test_an_annotated_model_compiles_in_one_graph():
    model = _annotated()
    before = model[0].weight.detach().clone()
    model.compile(fullgraph=True)
    model(torch.randn(3, 4)).sum().backward()
    assert (model[0].weight - before).abs().max() > 0.05


def test_torch_compile_of_a_module_warns_while_the_watch_is_on():
    """torch.compile(module) warns that global hooks fire once more, for its OptimizedModule (the
    watch skips it: not an FSDP module); what docs/dense.md tells users to expect."""
    model = _annotated()
    with pytest.warns(UserWarning, match="global hooks on modules"):
        torch.compile(model)(torch.randn(3, 4))


def test_a_compiled_model_sharded_by_overlap_optim_trains(world_of_one):
    model = _annotated()
    overlap_optim.fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    before = model[0].weight.full_tensor().clone()
    compiled = model.compile()  # in place: no OptimizedModule, no warning about global hooks
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
    assert compiled is None and (model[0].weight.full_tensor() - before).abs().max() > 0.05


def test_a_compiled_model_sharded_by_torch_is_refused_at_its_first_forward(world_of_one):
    from torch.distributed.fsdp import fully_shard

    model = _annotated()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    before = model[0].weight.full_tensor().clone()
    model.compile()
    with pytest.raises(RuntimeError, match=r"4 annotated parameter\(s\), '0.weight' \(4, 4\) \(Adam\).* were sharded by "
                                           r"torch's fully_shard.*overlap_optim.fully_shard"):
        model(torch.randn(3, 4))
    assert torch.equal(model[0].weight.full_tensor(), before)
