"""Rank bodies for test_lazy_reference.py (spawned; not collected by pytest).

Our sharded model against unsharded references whose tables make sparse gradients
(``nn.EmbeddingBag.sparse = True``) and are stepped by torch's own sparse optimizers,
on batches that touch about a third of each table's rows.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import KeyedJaggedTensor

import sharders
from sharders.describe import kernel_rows
from _models import ROWS, concat_batches, loss_of, without_compiled_operators
from _sharded_parity import FAMILIES, build

ADAM_LR, BETA2 = 0.05, 0.999
# table -> (our annotation, the reference's torch optimizer and its kwargs)
CASES = {
    "adam_eps_tiny": ((torch.optim.Adam, {"lr": ADAM_LR, "eps": 1e-12}),
                      (torch.optim.SparseAdam, {"lr": ADAM_LR, "eps": 1e-12})),
    "adam": ((torch.optim.Adam, {"lr": ADAM_LR}),  # default eps=1e-8; reference eps rescaled each step
             (torch.optim.SparseAdam, {"lr": ADAM_LR, "eps": 1e-8})),
    "adagrad_lr_decay": ((torch.optim.Adagrad, {"lr": 0.2, "lr_decay": 0.1}),
                         (torch.optim.Adagrad, {"lr": 0.2, "lr_decay": 0.1})),
    "sgd_fused": ((torch.optim.SGD, {"lr": 0.5}), (torch.optim.SGD, {"lr": 0.5})),
    "sgd_fallback": ((torch.optim.SGD, {"lr": 0.5}), (torch.optim.SGD, {"lr": 0.5})),
}
NAMES = list(CASES)
PINNED = ("sgd_fallback",)
ADAM_TABLES = ("adam_eps_tiny", "adam")
TOUCHED = ROWS // 3  # rows each global batch touches per table
HALF_ONLY_STEP = 2  # this step touches rows of the first half only: a row_wise shard sits idle
EMPTY_STEP, EMPTY_TABLES = 4, ("adam", "adagrad_lr_decay")  # no ids at all for these tables
STEPS = 6


def step_rows(step: int) -> dict[str, list[int]]:
    """Table -> the rows the global batch of ``step`` touches (the same on every rank)."""
    generator = torch.Generator().manual_seed(500 + step)
    rows = {}
    for name in NAMES:
        pool = ROWS // 2 if step == HALF_ONLY_STEP else ROWS
        chosen = torch.randperm(pool, generator=generator)[:TOUCHED]
        rows[name] = [] if step == EMPTY_STEP and name in EMPTY_TABLES else sorted(chosen.tolist())
    return rows


def partial_batches(step: int, world_size: int, batch: int = 4):
    """One local batch per rank, touching exactly ``step_rows(step)``: rank 0's first bag holds
    every chosen row, every other bag 1-3 ids drawn from them (repeats included)."""
    rows = step_rows(step)
    generator = torch.Generator().manual_seed(100 + step)
    parts = []
    for rank in range(world_size):
        lengths, values = [], []
        for name in NAMES:
            pool = torch.tensor(rows[name], dtype=torch.long)
            for sample in range(batch):
                if pool.numel() == 0:
                    ids = pool
                elif rank == 0 and sample == 0:
                    ids = pool[torch.randperm(pool.numel(), generator=generator)]
                else:
                    count = int(torch.randint(1, 4, (1,), generator=generator))
                    ids = pool[torch.randint(0, pool.numel(), (count,), generator=generator)]
                lengths.append(ids.numel())
                values.append(ids)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f_{n}" for n in NAMES], values=torch.cat(values), lengths=torch.tensor(lengths)
        )
        parts.append((kjt, torch.randn(batch, generator=generator)))
    return parts, rows


class Reference:
    """An unsharded copy of the model with its own optimizer per table. Its tables make sparse
    gradients but ``dense_tables``; ``rescale_eps``: SparseAdam tables whose eps is set before
    step t to ``eps * sqrt(1 - beta2**t)``, Adam's placement of eps."""

    def __init__(self, model, optimizers: dict[str, tuple[type, dict]], dense_tables=(), rescale_eps=()):
        self.model = copy.deepcopy(model)
        for name in NAMES:
            self.model.tables[name].sparse = name not in dense_tables
        self.opts = {n: cls(self.model.tables[n].parameters(), **kw) for n, (cls, kw) in optimizers.items()}
        self.rescale_eps = {n: self.opts[n].param_groups[0]["eps"] for n in rescale_eps}

    def weight(self, name):
        return self.model.tables[name].weight.detach()

    def train_step(self, batch, t: int) -> dict[str, str]:
        """Step ``t`` (1-based); returns each table's gradient layout (sparse or strided)."""
        loss_of(self.model, batch).backward()
        layouts = {n: str(self.model.tables[n].weight.grad.layout) for n in NAMES}
        for name, opt in self.opts.items():
            if name in self.rescale_eps:
                opt.param_groups[0]["eps"] = self.rescale_eps[name] * math.sqrt(1 - BETA2**t)
            opt.step()
        self.model.zero_grad()
        return layouts


def local_pieces(dmp) -> dict[str, list[tuple[int, int, torch.Tensor]]]:
    """Table -> [(row offset, col offset, local tensor)] this rank holds (one state_dict call:
    _sharded_parity.local_pieces makes one per table, and state_dict is the slow part)."""
    state = dmp.state_dict()
    out = {}
    for name in NAMES:
        value = state[dmp.module.table_key(name)]
        out[name] = ([(s.metadata.shard_offsets[0], s.metadata.shard_offsets[1], s.tensor) for s in value.local_shards()]
                     if isinstance(value, ShardedTensor) else [(0, 0, value)])
    return out


def _diffs(pieces, reference: Reference, names) -> dict[str, float]:
    """Table -> largest difference between this rank's pieces and the reference."""
    out = {}
    for name in names:
        ref = reference.weight(name)
        out[name] = max(
            [(p - ref[r : r + p.shape[0], c : c + p.shape[1]]).abs().max().item() for r, c, p in pieces[name]
             if p.numel()],
            default=0.0,
        )
    return out


def lazy_run(rank: int, world_size: int, sharding_type: str, family: str = "ebc", one_pass: bool = True) -> dict:
    """Train ours and three references side by side for STEPS steps; per step, how far ours is
    from each (``diff``: the torch sparse optimizers; ``plain_diff``: SparseAdam with eps not
    rescaled; ``dense_diff``: torch.optim.Adam on dense gradients) and which rows moved.
    ``one_pass=False``: as where the compiled one-pass extension was not built."""
    settings = [CASES[n][0] for n in NAMES]
    sharder = FAMILIES[family][1](fallback_tables=list(PINNED))
    with contextlib.nullcontext() if one_pass else without_compiled_operators():
        dmp, start_model, _ = build(NAMES, settings, sharding_type, world_size, sharder=sharder, family=family)
    kernels = {}
    for module in dmp.modules():
        for name, decision in (getattr(sharders.plan_of(module), "tables", None) or {}).items():
            kernels[name] = (decision.kernel, decision.semantics)

    main = Reference(start_model, {n: CASES[n][1] for n in NAMES}, rescale_eps=("adam",))
    # SparseAdam at the default eps, not rescaled: what the rescaling is for.
    plain = Reference(start_model, {n: CASES[n][1] for n in NAMES})
    # The mutation a dense implementation would be: torch.optim.Adam on dense gradients.
    dense_opts = {n: CASES[n][1] for n in NAMES}
    dense_opts.update({n: CASES[n][0] for n in ADAM_TABLES})
    dense = Reference(start_model, dense_opts, dense_tables=ADAM_TABLES)

    start = {n: main.weight(n).clone() for n in NAMES}
    out = {"kernels": kernels, "steps": [], "moved": {}, "layouts": {}, "dense_layouts": {},
           "one_pass": sorted(n for row in kernel_rows(dmp) if "one compiled pass" in row[6] for n in row[4].split(", "))}
    for step in range(STEPS):
        parts, rows = partial_batches(step, world_size)
        global_batch = concat_batches(parts)
        ours_before = {n: [(r, p.clone()) for r, _, p in pieces] for n, pieces in local_pieces(dmp).items()}
        ref_before = {n: main.weight(n).clone() for n in NAMES}
        loss_of(dmp, parts[rank]).backward()
        out["layouts"] = main.train_step(global_batch, step + 1)
        plain.train_step(global_batch, step + 1)
        out["dense_layouts"] = dense.train_step(global_batch, step + 1)
        ours = local_pieces(dmp)
        record = {"rows": rows, "diff": _diffs(ours, main, NAMES), "plain_diff": _diffs(ours, plain, ADAM_TABLES),
                  "dense_diff": _diffs(ours, dense, ADAM_TABLES), "ours_untouched_moved": [],
                  "ref_untouched_moved": [], "ref_touched_moved": {}, "local_touched": {}}
        for name in NAMES:
            untouched = torch.ones(ROWS, dtype=torch.bool)
            untouched[rows[name]] = False
            after = main.weight(name)
            if not torch.equal(after[untouched], ref_before[name][untouched]):
                record["ref_untouched_moved"].append(name)
            record["ref_touched_moved"][name] = (
                (after[~untouched] - ref_before[name][~untouched]).abs().max().item() if rows[name] else 0.0)
            local_t = 0
            for (row0, old), (_, _, new) in zip(ours_before[name], ours[name]):
                mask = untouched[row0 : row0 + new.shape[0]]
                local_t += int((~mask).sum())
                if not torch.equal(old[mask], new[mask]):
                    record["ours_untouched_moved"].append(name)
            record["local_touched"][name] = local_t
        out["steps"].append(record)
    out["moved"] = {n: (main.weight(n) - start[n]).abs().max().item() for n in NAMES}
    return out
