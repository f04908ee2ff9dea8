"""The core's layout, counted: what issue 40 consolidated stays consolidated.

Each count is read from the source (``python tests/test_layout.py`` prints them):

- raw ``_overlap_*`` attributes outside ``overlap_optim/record.py``: 0 (everything kept on a
  parameter or a module sits in its record, behind ``record_of`` and ``module_record``);
- implementations of the gradient path: 1 (only ``gradient_path.take`` hands gradients to a
  clipping set; every participant calls it);
- module-level (or class-level) mutable state written after import: 0, but for the schedule of
  the running backward (``round._SCHEDULE``), which mirrors the autograd engine's own queue of
  end-of-backward callbacks: it holds the rounds armed in the backward that runs, and is emptied
  when that backward ends (or, if it raised, when the next one arms a round); and the test
  harness's pool of spawned ranks (``overlap_optim.testing``), which holds no training state.

The private-API count is ``tests/test_private_apis.py``'s.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("overlap_optim", "sharders")
# Mutated after import, on purpose: name -> why (keep this short).
ALLOWED_STATE = {
    "overlap_optim/round.py:_SCHEDULE": "the running backward's armed rounds, emptied when it ends",
    "overlap_optim/testing.py:_open": "the harness's pool of spawned ranks, reused by run_cases (no training state)",
    "overlap_optim/testing.py:_batches": "the harness's count of batches of cases sent to that pool",
}
_MUTATORS = {"append", "extend", "add", "update", "setdefault", "pop", "popitem", "clear", "insert", "remove",
             "discard", "arm", "run", "__setitem__"}


def _sources() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for package in PACKAGES for path in sorted((ROOT / package).glob("*.py"))
    }


def raw_record_attributes() -> list[str]:
    """``file:line`` of every ``_overlap_`` name outside record.py."""
    return [f"{name}:{n}" for name, text in _sources().items() if name != "overlap_optim/record.py"
            for n, line in enumerate(text.splitlines(), 1) if "_overlap_" in line]


def gradient_paths() -> list[str]:
    """``file:function`` of every function outside clipping.py that hands gradients to a clipping
    set (calls ``.clip(`` or ``.hold(``)."""
    found = []
    for name, text in _sources().items():
        if name == "overlap_optim/clipping.py":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                         and c.func.attr in ("clip", "hold")]
                if calls:
                    found.append(f"{name}:{node.name}")
    return found


def mutable_state() -> list[str]:
    """``file:name`` of every module- or class-level name bound to a container, a counter or an
    instance of a class of the same module, that a function mutates (a method call that changes
    it, an item assignment, ``next()``, or ``global``)."""
    found = []
    for name, text in _sources().items():
        tree = ast.parse(text)
        classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        candidates = {}
        scopes = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
        for body in scopes:
            for node in body:
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
                value = getattr(node, "value", None)
                for target in targets:
                    if isinstance(target, ast.Name) and _is_mutable(value, classes):
                        candidates[target.id] = node
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
        for state in candidates:
            if any(_mutates(f, state) for f in functions):
                found.append(f"{name}:{state}")
    return found


def _is_mutable(value: ast.AST | None, classes: set[str]) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        called = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
        return called in {"dict", "list", "set", "defaultdict", "OrderedDict", "count", "WeakKeyDictionary",
                          "WeakValueDictionary", "WeakSet", "local"} or called in classes
    return False


def _mutates(function: ast.AST, state: str) -> bool:
    for node in ast.walk(function):
        if isinstance(node, ast.Global) and state in node.names:
            return True
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "next" and node.args and _names(node.args[0], state):
                return True
            if isinstance(func, ast.Attribute) and func.attr in _MUTATORS and _names(func.value, state):
                return True
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            if any(isinstance(t, ast.Subscript) and _names(t.value, state) for t in targets):
                return True
    return False


def _names(node: ast.AST, state: str) -> bool:
    """``node`` is ``state``, ``Class.state`` or ``self.state``."""
    return (isinstance(node, ast.Name) and node.id == state) or (isinstance(node, ast.Attribute) and node.attr == state)


def test_no_raw_record_attribute_outside_record_py():
    assert raw_record_attributes() == []


def test_one_implementation_of_the_gradient_path():
    assert gradient_paths() == ["overlap_optim/gradient_path.py:take"]


def test_no_module_level_state_written_after_import():
    assert sorted(mutable_state()) == sorted(ALLOWED_STATE)


def test_the_counter_finds_what_it_counts():
    """A planted mutable module-level dict, a class counter and an instance are each found."""
    planted = (
        "import itertools\nSEEN = {}\nclass A:\n    made = itertools.count()\n    def __init__(self):\n"
        "        self.order = next(A.made)\nclass S:\n    pass\n_ONE = S()\ndef f(x):\n    SEEN[x] = 1\n"
        "    _ONE.arm(x)\n"
    )
    tree_functions = [n for n in ast.walk(ast.parse(planted)) if isinstance(n, ast.FunctionDef)]
    for state in ("SEEN", "made", "_ONE"):
        assert any(_mutates(f, state) for f in tree_functions), state


if __name__ == "__main__":
    print(f"raw _overlap_ attributes outside record.py: {len(raw_record_attributes())}")
    print(f"implementations of the gradient path: {len(gradient_paths())} {gradient_paths()}")
    state = mutable_state()
    print(f"module-level mutable state written after import: {len(state)} {state}")
