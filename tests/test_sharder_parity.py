"""The sharder gives every table exactly torch.optim's update, on every sharding type (2 ranks, gloo).

Reference: the same model unsharded in one process, plain torch.optim per table, fed the
concatenated global batch with a mean loss. Sharded: each rank its own local batch, mean loss.
Batches touch every row, so lazy and dense semantics coincide. Weights are compared after
every step.
"""

from __future__ import annotations

import torch
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from overlap_optim.testing import run_ranks
from _sharded_parity import SHARDING_TYPES, matrix

CASES = [
    ("sgd", torch.optim.SGD, {"lr": 0.1}),
    ("sgd_momentum", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ("sgd_nesterov", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("sgd_wd", torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.05}),
    ("adagrad", torch.optim.Adagrad, {"lr": 0.2}),
    ("adagrad_eps_wd", torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-6, "weight_decay": 0.05}),
    ("adagrad_lr_decay", torch.optim.Adagrad, {"lr": 0.2, "lr_decay": 0.1}),
    ("adagrad_init_acc", torch.optim.Adagrad, {"lr": 0.2, "initial_accumulator_value": 0.3}),
    ("adam", torch.optim.Adam, {"lr": 0.05}),
    ("adam_betas_wd", torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.95), "weight_decay": 0.05}),
    ("adam_amsgrad", torch.optim.Adam, {"lr": 0.05, "amsgrad": True}),
    ("adamw", torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    ("rmsprop", torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    ("adamax", torch.optim.Adamax, {"lr": 0.05}),
    ("nadam", torch.optim.NAdam, {"lr": 0.05}),
    ("radam", torch.optim.RAdam, {"lr": 0.05}),
    ("rowwise_adagrad", RowWiseAdagrad, {"lr": 0.2}),
    ("rowwise_adagrad_wd", RowWiseAdagrad, {"lr": 0.2, "weight_decay": 0.05}),  # FBGEMM CPU drops wd
]


def test_every_optimizer_on_every_sharding_type_matches_torch_optim():
    per_rank = run_ranks(matrix, CASES, timeout=600)
    for sharding_type in SHARDING_TYPES:
        moved = per_rank[0][sharding_type]
        assert set(moved) >= {c[0] for c in CASES if c[1] is not RowWiseAdagrad}, sharding_type
        still = [n for n, distance in moved.items() if n not in ("dense", "dense_diff") and distance < 1e-3]
        assert not still, f"{sharding_type}: the reference did not move {still}"
