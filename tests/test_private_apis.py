"""Every private torch (and TorchRec) API we touch still exists, and is touched in one place only.

Each entry of ``overlap_optim._private.PRIVATE_APIS`` (and of
``sharders._private.PRIVATE_APIS``, once that module exists) is its own test
case, so an upgrade that removes one names it, and the function of ``_private``
that needs a new route.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
IMPORT = "(the module imports)"


def _exists(name: str) -> bool:
    """Whether module ``name`` exists (found without running its package, which may be broken)."""
    parent, _, child = name.rpartition(".")
    spec = importlib.util.find_spec(parent)
    return spec is not None and any((Path(p) / f"{child}.py").is_file() for p in spec.submodule_search_locations or ())


def _registry(name: str) -> list[str]:
    try:
        return list(importlib.import_module(name).PRIVATE_APIS)
    except Exception:  # noqa: BLE001 - reported by its own test case
        return [IMPORT]


MODULES = [name for name in ("overlap_optim._private", "sharders._private") if _exists(name)]
ENTRIES = [(module, api) for module in MODULES for api in _registry(module)]

# Only overlap_optim/_private.py may spell these.
CONFINED = ("._execution_engine", "_lazy_init_ran", "_set_optimizer_in_backward",
            "_init_from_local_shards_and_global_metadata", "torch._foreach_",
            "torch._fused_")




def _route(module, api: str) -> str:
    """The functions of ``module`` whose source names the last part of ``api`` (or, for a family
    such as ``torch._foreach_mul_``, its prefix): what needs a new route."""
    last = api.split()[0].rstrip(",").split(".")[-1]
    own = [(name, inspect.getsource(obj)) for name, obj in vars(module).items()
           if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__]
    for needle in (last, re.sub(r"[a-z]+_?$", "", last)):
        names = [name for name, source in own if needle in source]
        if names:
            return ", ".join(names)
    return "the code that uses it"


def _versions() -> str:
    try:
        return f"torch {torch.__version__}, torchrec {importlib.metadata.version('torchrec')}"
    except importlib.metadata.PackageNotFoundError:
        return f"torch {torch.__version__}"


@pytest.mark.parametrize("module_name, api", ENTRIES, ids=[f"{m.split('.')[0]}: {api}" for m, api in ENTRIES])
def test_private_api_still_exists(world_of_one, module_name, api):
    module = importlib.import_module(module_name)  # IMPORT: fails here, naming the error
    try:
        module.PRIVATE_APIS[api]()
        return
    except Exception as err:  # noqa: BLE001 - any failure means the route is broken
        error = f"{type(err).__name__}: {err}"
    path = module_name.replace(".", "/") + ".py"
    pytest.fail(
        f"private API {api} is gone in {_versions()}: {path} {_route(module, api)} needs a new route ({error})",
        pytrace=False,
    )


def test_the_registry_lists_the_private_apis_the_core_uses():
    from overlap_optim import _private

    names = set(_private.PRIVATE_APIS)
    assert "torch.autograd.Variable._execution_engine.queue_callback" in names
    assert {f"torch._foreach_{op}" for op in _private._FOREACH_OPS} <= names
    assert any("_apply_optimizer_in_backward" in name and "_in_backward_optimizers" in name for name in names)


def test_foreach_calls_torchs_op_of_the_moment():
    """Looked up at each use, so a patched torch op is the one called (as test_step_params relies on)."""
    from unittest import mock

    from overlap_optim._private import foreach

    tensors = [torch.ones(2)]
    with mock.patch("torch._foreach_mul_", wraps=torch._foreach_mul_) as mul:
        foreach.mul_(tensors, 3.0)
    assert mul.call_count == 1 and torch.equal(tensors[0], torch.full((2,), 3.0))
    with pytest.raises(AttributeError):
        foreach.not_an_op  # noqa: B018


@pytest.mark.parametrize("needle", CONFINED)
def test_only_private_py_touches_private_torch_apis(needle):
    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "overlap_optim").rglob("*.py"))
        if path.name != "_private.py" and needle in path.read_text()
    ]
    assert not offenders, f"{needle!r} outside overlap_optim/_private.py, in {offenders}: add a function there"
