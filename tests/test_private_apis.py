"""Every private torch (and TorchRec) API we touch still exists, and is touched in one place only.

Each entry of ``overlap_optim._private.PRIVATE_APIS`` (and of
``sharders._private.PRIVATE_APIS``, once that module exists) is its own test
case, so an upgrade that removes one names it, and the function of ``_private``
that needs a new route.
"""

from __future__ import annotations

import ast
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


# -- private torch/TorchRec/FBGEMM APIs outside the two _private.py modules: counted, 0 --

THIRD_PARTY = ("torch", "torchrec", "fbgemm_gpu")
# torch's annotation contract (``_optimizer_classes``, ...): probed by ``_annotation_contract``; its
# reads and writes are gathered by the per-parameter record (issue 40, move 1), not here.
CONTRACT = ("_optimizer_classes", "_optimizer_kwargs", "_in_backward_optimizers")
STDLIB = {("os", "_exit")}  # documented functions of the standard library


def _private_name(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.startswith("_overlap")


def _ours(trees: dict[Path, ast.Module]) -> set[str]:
    """Every name our code defines: functions, classes, variables, arguments, attributes it sets."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Attribute, ast.Name)) and isinstance(node.ctx, ast.Store):
                names.add(node.attr if isinstance(node, ast.Attribute) else node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
    return names


def _inherited(root: Path, path: Path, tree: ast.Module) -> dict[int, set[str]]:
    """Line -> the private names a torch/TorchRec base class uses, for each class of ``path`` with one."""
    module = importlib.import_module(".".join(path.relative_to(root).with_suffix("").parts))
    lines = {}
    for node in ast.walk(tree):
        cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
        if not isinstance(cls, type):
            continue
        bases = [base for base in cls.__mro__[1:] if base.__module__.split(".")[0] in THIRD_PARTY]
        codes = [value.__code__ for base in bases for value in vars(base).values() if hasattr(value, "__code__")]
        theirs = {name for code in codes for name in code.co_names}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                if sub.attr in theirs and _private_name(sub.attr):
                    lines.setdefault(sub.lineno, set()).add(sub.attr)
    return lines


def private_api_sites(root: Path = ROOT) -> list[str]:
    """``path:line: what`` for each use of a private torch, TorchRec or FBGEMM API outside the two
    ``_private.py`` modules: an import of a private module or name, an attribute or attribute name
    (a string) that our code does not define, a private attribute a torch/TorchRec base class of
    ours uses, and a ``__class__`` swap."""
    files = [p for d in ("overlap_optim", "sharders") for p in sorted((root / d).rglob("*.py"))]
    trees = {p: ast.parse(p.read_text()) for p in files if p.name != "_private.py"}
    ours = _ours(trees) - set(CONTRACT)
    ours |= {p.name.split(".")[0] for d in ("overlap_optim", "sharders") for p in (root / d).iterdir()}  # _compiled
    sites = []
    for path, tree in trees.items():
        where = path.relative_to(root)
        for line, names in _inherited(root, path, tree).items():
            sites += [f"{where}:{line}: .{name} (a base class's)" for name in sorted(names)]
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                base = getattr(node, "module", None) or ""
                for alias in node.names:
                    full = f"{base}.{alias.name}" if base else alias.name
                    if full.split(".")[0] in THIRD_PARTY and any(_private_name(s) for s in full.split(".")):
                        sites.append(f"{where}:{node.lineno}: import {full}")
            elif isinstance(node, ast.Attribute):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if node.attr == "__class__" and isinstance(node.ctx, ast.Store):
                    sites.append(f"{where}:{node.lineno}: __class__ swap")
                elif _private_name(node.attr) and node.attr not in ours and node.attr not in CONTRACT \
                        and (owner, node.attr) not in STDLIB:
                    sites.append(f"{where}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # a name, or a dotted path of names
                if any(part.isidentifier() and _private_name(part) and part not in ours and part not in CONTRACT
                       for part in node.value.split(".")):
                    sites.append(f"{where}:{node.lineno}: {node.value!r}")
    unique = {site.removesuffix(" (a base class's)"): site for site in sites}  # one site, found twice
    return sorted(unique.values(), key=lambda site: (site.split(":")[0], int(site.split(":")[1])))


def test_no_private_api_outside_the_private_modules():
    sites = private_api_sites()
    assert not sites, "private APIs outside the _private.py modules; add a function there:\n" + "\n".join(sites)


if __name__ == "__main__":  # the count: python tests/test_private_apis.py [repository root]
    import sys

    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
    sys.path.insert(0, str(root))  # its packages, not the installed ones
    found = private_api_sites(root)
    print("\n".join(found + [f"{len(found)} private-API sites outside the _private.py modules"]))
