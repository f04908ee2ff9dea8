"""The optional compiled operators, and whether they loaded.

``setup.py`` builds ``overlap_optim/csrc/*.cpp`` into one library with torch's extension
builder when a C++ compiler is at hand; it registers its operators with torch
(``torch.ops.overlap_optim.<name>``). Each caller keeps a path that needs none of them
(same results, slower), taken when :func:`op` is None:

- ``adam_rows_``: the one-pass Adam of a table's touched rows (:mod:`overlap_optim.row_pass`);
- ``fused_rows_step_``, ``fused_rows_coalesce``, ``fused_rows_apply_``: a fused table's backward
  (SGD, Adagrad, row-wise Adagrad) from its lookup's output gradient (:mod:`sharders.fused_rows`);
- ``add_one_``: torch.optim's ``step`` counters advanced in one call
  (:func:`overlap_optim.virtual_groups.step_counters`).
"""

from __future__ import annotations

import importlib.machinery
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["available", "op"]


def _load() -> bool:
    """Load the library; False where it was not built (or does not load: warned)."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        library = here / f"_compiled{suffix}"
        if library.exists():
            try:
                torch.ops.load_library(str(library))
            except OSError as error:  # built against another torch, say
                warnings.warn(f"overlap_optim: {library} does not load ({error}); the slower pure-torch paths "
                              "run instead. Rebuild it: make clean env", stacklevel=2)
                return False
            return True
    return False


_LOADED = _load()


def available() -> bool:
    """Whether the compiled library was built and loaded."""
    return _LOADED


def op(name: str) -> Any:
    """The operator ``torch.ops.overlap_optim.<name>``, or None where the library is absent."""
    return getattr(torch.ops.overlap_optim, name) if _LOADED else None
