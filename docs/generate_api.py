"""Write the API reference, docs/api.md, from the code's own signatures and docstrings.

    python docs/generate_api.py          # rewrites docs/api.md (a test checks it is current)
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

MODULES = ("overlap_optim", "overlap_optim.checkpoint", "sharders")
TARGET = Path(__file__).resolve().parent / "api.md"


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _entry(module: str, name: str, obj) -> list[str]:
    kind = "class" if inspect.isclass(obj) else "function"
    lines = [f"### `{module}.{name}{_signature(obj)}`", "", f"*{kind}*", "", inspect.getdoc(obj) or "(no docstring)", ""]
    if inspect.isclass(obj):
        for attr, member in vars(obj).items():
            if attr.startswith("_") or not callable(member) or not getattr(member, "__doc__", None):
                continue
            summary = inspect.getdoc(member).split("\n\n")[0].replace("\n", " ")
            lines.append(f"- `{attr}{_signature(member)}`: {summary}")
        lines.append("")
    return lines


def render() -> str:
    lines = ["# API reference", "",
             "Generated from the code by `python docs/generate_api.py`; a test keeps it current.", ""]
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        lines += [f"## `{module_name}`", "", (inspect.getdoc(module) or "").split("\n\n")[0], ""]
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue
            lines += _entry(module_name, name, obj)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    TARGET.write_text(render())
    print(f"wrote {TARGET}", file=sys.stderr)
