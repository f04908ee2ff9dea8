"""Rank bodies for tests/test_two_dimensional.py (spawned; not collected by pytest), and the test-only
stand-in for TorchRec's ``DMPCollection`` on CPU.

``DMPCollection.__init__`` asserts a CUDA or MTIA device (stock TorchRec alike). :func:`cpu_dmp_collection`
builds a subclass whose ``__init__`` is TorchRec's own source with that one assert removed (and its
``super()`` spelled out, so that it reaches ``DistributedModelParallel``). Nothing of TorchRec is
changed; it lives here, for tests only.
"""

from __future__ import annotations

import inspect
import re
import textwrap

import torch
import torch.distributed as dist
from torchrec.distributed import model_parallel
from torchrec.distributed.planner import EmbeddingShardingPlanner as StockPlanner
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.types import ShardedModule

import overlap_optim
import sharders
from _models import ManyTableModel

_ASSERT = re.compile(r"assert \(\s*device\.type == \"cuda\" or device\.type == \"mtia\"\s*\), \"DMPCollection only supports CUDA or MTIA\"\n")


def cpu_dmp_collection() -> type:
    """``DMPCollection`` with its CUDA assert lifted; raises if TorchRec's source no longer has it."""
    source = textwrap.dedent(inspect.getsource(model_parallel.DMPCollection.__init__))
    lifted, found = _ASSERT.subn("", source)
    if found != 1 or "super().__init__(" not in lifted:
        raise AssertionError("DMPCollection.__init__ changed: the CPU stand-in needs a new look")
    lifted = lifted.replace("super().__init__(", "model_parallel.DistributedModelParallel.__init__(self, ")
    namespace = dict(vars(model_parallel), model_parallel=model_parallel)
    exec(compile(lifted, model_parallel.__file__, "exec"), namespace)
    return type("CPUDMPCollection", (model_parallel.DMPCollection,), {"__init__": namespace["__init__"]})


def refused(rank: int, world_size: int, wrapper_only: bool = False) -> dict:
    """A model of two tables (fused Adagrad, fallback Adam) and an annotated MLP under the CPU
    DMPCollection, 2 ranks in one sharding group of 1 (two replicas): the error each rank raises,
    and which modules were sharded by then. ``wrapper_only``: an empty plan (no table sharded), so our
    DataParallelWrapper alone meets the 2D environment."""
    names = ["adagrad", "adam"]
    model = ManyTableModel(names)
    for name, (cls, kwargs) in zip(names, [(torch.optim.Adagrad, {"lr": 0.1}), (torch.optim.Adam, {"lr": 0.01})]):
        overlap_optim.apply_optimizer_in_backward(cls, model.tables[name].parameters(), kwargs)
    overlap_optim.apply_optimizer_in_backward(torch.optim.Adam, model.dense.parameters(), {"lr": 0.01})
    ours = [] if wrapper_only else [sharders.EmbeddingBagCollectionSharder()]
    plan_sharders = ours or None
    constraints = {n: ParameterConstraints(sharding_types=["table_wise"]) for n in names}
    plan = StockPlanner(topology=Topology(world_size=1, compute_device="cpu", local_world_size=1),
                        constraints=constraints).plan(model, plan_sharders or [])
    try:
        cpu_dmp_collection()(
            model, device=torch.device("cpu"), plan=plan, world_size=world_size, sharding_group_size=1,
            global_pg=dist.group.WORLD, sharders=plan_sharders, data_parallel_wrapper=sharders.DataParallelWrapper(),
        )
        error = "no error"
    except Exception as err:  # what the user sees
        error = f"{type(err).__name__}: {err}"
    return {"error": error, "sharded": [p for p, m in model.named_modules() if isinstance(m, ShardedModule)]}
