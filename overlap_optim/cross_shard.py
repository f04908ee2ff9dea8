"""The registry of cross-shard forms: which
:class:`~overlap_optim.cross_shard_base.CrossShardOptimizer` steps an optimizer class on a
tensor split across ranks.

:data:`CROSS_SHARD` is a plain dict ``optimizer class -> implementation`` for matrices,
:data:`CROSS_SHARD_VECTOR` the same for vectors (Muon, as torch's, steps matrices only).
Classes from optional packages (pytorch-optimizer's ``Lamb``, ``LARS`` and ``GaLore``,
came-pytorch's ``CAME``) are found only once the user's code has imported that package; the core imports
none of them. :func:`cross_shard_class` answers for both; a class it has no form for stays
refused on a split tensor.
"""

from __future__ import annotations

import sys

import torch
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from overlap_optim.cross_shard_adafactor import AdafactorTable, AdafactorVector
from overlap_optim.cross_shard_adagrad import RowWiseAdagradTable
from overlap_optim.cross_shard_base import CrossShardOptimizer
from overlap_optim.cross_shard_came import CameTable, CameVector
from overlap_optim.cross_shard_galore import GaLoreTable
from overlap_optim.cross_shard_lamb import LambTable, LarsTable
from overlap_optim.cross_shard_muon import MuonTable

__all__ = ["CROSS_SHARD", "CROSS_SHARD_VECTOR", "cross_shard_class"]

# optimizer class -> its cross-shard implementation on a matrix, and on a vector (Muon, as
# torch's, steps matrices only). Classes of optional packages are looked up by name in
# _OPTIONAL, once their package is imported (the core never imports them).
CROSS_SHARD: dict[type, type[CrossShardOptimizer]] = {
    torch.optim.Adafactor: AdafactorTable, torch.optim.Muon: MuonTable, RowWiseAdagrad: RowWiseAdagradTable,
}
CROSS_SHARD_VECTOR: dict[type, type[CrossShardOptimizer]] = {torch.optim.Adafactor: AdafactorVector}
_OPTIONAL = {  # (package, class name) -> (matrix form, vector form)
    ("pytorch_optimizer", "Lamb"): (LambTable, LambTable),
    ("pytorch_optimizer", "LARS"): (LarsTable, LarsTable),
    ("came_pytorch", "CAME"): (CameTable, CameVector),
    ("pytorch_optimizer", "GaLore"): (GaLoreTable, None),  # on a vector, GaLore is Adam: element-wise
}


def cross_shard_class(optimizer_class: type, ndim: int = 2) -> type[CrossShardOptimizer] | None:
    """The implementation for ``optimizer_class`` on a tensor of ``ndim`` dims (2: a table or
    matrix, 1: a vector), or None: it stays refused on such a tensor split across ranks."""
    if ndim not in (1, 2):
        return None
    found = (CROSS_SHARD if ndim == 2 else CROSS_SHARD_VECTOR).get(optimizer_class)
    if found is not None:
        return found
    for (package, name), forms in _OPTIONAL.items():
        module = sys.modules.get(package)
        if module is not None and getattr(module, name, None) is optimizer_class:
            return forms[2 - ndim]
    return None
