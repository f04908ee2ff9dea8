"""Rank bodies for test_checkpoint_compat.py (spawned; not collected by pytest).

One model and plan, shared by the fixture's generator (``fixtures/make_pre_virtual_groups.py``,
run on the code before virtual parameter groups) and the test (run on the code after them):
six tables annotated with ``torch.optim.Adam`` in six calls at six learning rates (fallback
kernel), one ``torch.optim.Adagrad`` table (fused FBGEMM kernel), the MLP's ``dense[0]`` under
``Adam`` through ``sharders.DataParallelWrapper``; every table row_wise on 2 ranks.

The reference is the unsharded model with one torch optimizer per table, on the global batch.
Batches leave some rows untouched, where our sharded tables are lazy (README), so the Adam
tables' reference is ``torch.optim.SparseAdam`` on sparse gradients with eps set before step t
to ``eps * sqrt(1 - beta2**t)`` (Adam's placement of eps; see test_lazy_reference.py), and the
Adagrad table's is ``torch.optim.Adagrad`` on sparse gradients. The MLP is dense: ``Adam``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import overlap_optim
from _models import ManyTableModel, concat_batches, covering_batch, loss_of
from _sharded_parity import build, compare, local_pieces
from overlap_optim import checkpoint

ADAM_LRS = (0.01, 0.02, 0.03, 0.05, 0.08, 0.13)
ADAM_TABLES = [f"adam{i}" for i in range(len(ADAM_LRS))]
NAMES = ADAM_TABLES + ["adagrad"]
SETTINGS = [(torch.optim.Adam, {"lr": lr}) for lr in ADAM_LRS] + [(torch.optim.Adagrad, {"lr": 0.1})]
DENSE = (torch.optim.Adam, {"lr": 0.02})
SHARDING_TYPE = "row_wise"
MODEL_SEED = 0
WORLD = 2
SAVED_AT = 3  # steps 0..2 trained by the old code, then saved
STEPS = 6  # steps 3..5 trained by the new code after loading
ADAM_EPS, ADAM_BETA2 = 1e-8, 0.999  # torch.optim.Adam's defaults, which the annotation keeps
REFERENCE_FILE = "reference.pt"


def batch_parts(step: int):
    """The global batch of ``step`` as one local batch per rank (seeded by the step: steps after
    the save draw other ids than those before it). Each global batch leaves up to 5 of a table's
    12 rows untouched (measured: 7 to 12 touched)."""
    generator = torch.Generator().manual_seed(100 + step)
    return [covering_batch(NAMES, generator, cover=False) for _ in range(WORLD)]


class Reference:
    """The unsharded model under plain torch.optim, one optimizer per table and one for dense[0]."""

    def __init__(self, seed: int = MODEL_SEED):
        self.model = ManyTableModel(NAMES, seed=seed)
        for name in NAMES:  # sparse gradients: torch's sparse optimizers are the lazy semantics
            self.model.ebc.embedding_bags[name].sparse = True
        bags = self.model.ebc.embedding_bags
        self.opts = {n: torch.optim.SparseAdam(bags[n].parameters(), lr=kw["lr"], eps=ADAM_EPS)
                     for n, (_, kw) in zip(ADAM_TABLES, SETTINGS)}
        self.opts["adagrad"] = SETTINGS[-1][0](bags["adagrad"].parameters(), **SETTINGS[-1][1])
        self.opts["dense"] = DENSE[0](self.model.dense[0].parameters(), **DENSE[1])
        self.steps = 0

    def step(self, parts) -> None:
        loss_of(self.model, concat_batches(parts)).backward()
        t = self.steps + 1
        for name in ADAM_TABLES:
            self.opts[name].param_groups[0]["eps"] = ADAM_EPS * math.sqrt(1 - ADAM_BETA2**t)
        for opt in self.opts.values():
            opt.step()
        self.model.zero_grad()
        self.steps = t

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optims": {n: o.state_dict() for n, o in self.opts.items()},
                "steps": self.steps}

    def load(self, saved: dict) -> None:
        self.model.load_state_dict(saved["model"])
        for name, opt in self.opts.items():
            opt.load_state_dict(saved["optims"][name])
        self.steps = saved["steps"]


def sharded(world_size: int, seed: int = MODEL_SEED):
    """(DMP model, its keyed optimizer): the fixture's model and plan, built by the code at hand."""
    dmp, _, _ = build(NAMES, SETTINGS, SHARDING_TYPE, world_size, dense=DENSE, seed=seed)
    return dmp, overlap_optim.get_optimizers(dmp)


def local_batch(parts, rank: int, world_size: int):
    return parts[rank] if world_size == WORLD else concat_batches(parts)


def train(dmp, reference: Reference, rank: int, world_size: int, steps, atol: float = 1e-5) -> list[float]:
    """Train both; after every step assert every weight within ``atol``; returns each step's max diff."""
    diffs = []
    for step in steps:
        parts = batch_parts(step)
        loss_of(dmp, local_batch(parts, rank, world_size)).backward()
        reference.step(parts)
        compare(dmp, reference.model, NAMES, step, atol=atol)
        diffs.append(max_diff(dmp, reference.model))
    return diffs


def max_diff(dmp, model) -> float:
    """Largest difference of this rank's weights (table pieces and MLP) from ``model``'s."""
    state = dmp.state_dict()
    worst = max((state[f"dense.{n}"] - p.detach()).abs().max().item() for n, p in model.dense.named_parameters())
    for name in NAMES:
        ref = model.ebc.embedding_bags[name].weight.detach()
        for row, col, piece in local_pieces(dmp, name):
            if piece.numel():
                worst = max(worst, (piece - ref[row : row + piece.shape[0], col : col + piece.shape[1]]).abs().max().item())
    return worst


def kernel_tables(dmp) -> list[list[str]]:
    """This rank's kernels of the sharded EBC, each as its list of tables."""
    from sharders.embeddingbag import kernels_of

    return [[t.name for t in kernel.config.embedding_tables] for _, kernel in kernels_of(dmp.module.ebc)]


def kernel_kinds(dmp) -> dict[str, str]:
    """Table -> "fused" or "fallback", as the sharder decided."""
    import sharders

    return {n: d.kernel for n, d in sharders.plan_of(dmp.module.ebc).tables.items()}


def _local(value) -> torch.Tensor:
    if hasattr(value, "local_shards"):
        return torch.cat([s.tensor for s in value.local_shards()]) if value.local_shards() else torch.empty(0)
    return value if torch.is_tensor(value) else torch.tensor(value)


def _row0(value) -> int:
    shards = value.local_shards() if hasattr(value, "local_shards") else []
    return shards[0].metadata.shard_offsets[0] if shards else 0


def state_diffs(keyed, reference: Reference) -> dict[str, float]:
    """``table.state`` -> largest difference between our loaded optimizer state (this rank's rows)
    and the reference optimizer's, for every state both hold under the same name."""
    ours = keyed.state_dict()["state"]
    out = {}
    for name in NAMES:
        param = reference.model.ebc.embedding_bags[name].weight
        ref_state = reference.opts[name].state[param]
        for key, value in ours[f"ebc.embedding_bags.{name}.weight"].items():
            if key not in ref_state:
                continue
            mine, theirs = _local(value).float(), torch.as_tensor(ref_state[key]).float()
            if theirs.dim():  # per-row state: this rank's rows of the reference's
                row0 = _row0(value)
                theirs = theirs[row0 : row0 + mine.shape[0]]
            out[f"{name}.{key}"] = (mine - theirs).abs().max().item() if mine.numel() else 0.0
    return out


def pieces(dmp, keyed) -> dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]]:
    """Every weight and optimizer state tensor (``model.<key>``, ``optim.<key>.<state>``): its
    whole shape and this rank's pieces [(offsets, tensor)]."""
    def split(value):
        if hasattr(value, "local_shards"):
            return tuple(value.metadata().size), [
                (tuple(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in value.local_shards()]
        value = torch.as_tensor(value).detach().clone()
        return tuple(value.shape), [((0,) * value.dim(), value)]

    out = {f"model.{k}": split(v) for k, v in dmp.state_dict().items()}
    for key, state in keyed.state_dict()["state"].items():
        out.update({f"optim.{key}.{name}": split(v) for name, v in state.items()})
    return out


def _where(offsets, tensor) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))


def assemble(by_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's ``pieces`` (a replicated tensor: the first rank's)."""
    out, filled = {}, set()
    for rank_pieces in by_rank:
        for key, (shape, parts) in rank_pieces.items():
            for offsets, tensor in parts:
                if key not in out:
                    out[key] = torch.full(shape, float("nan"), dtype=tensor.dtype) if tensor.is_floating_point() \
                        else torch.zeros(shape, dtype=tensor.dtype)
                if (key, offsets) not in filled:
                    out[key][_where(offsets, tensor)] = tensor
                    filled.add((key, offsets))
    assert not any(v.isnan().any() for v in out.values() if v.is_floating_point()), "a piece is missing"
    return out


def mismatches(mine: dict, saved: dict[str, torch.Tensor]) -> dict[str, float]:
    """Key -> largest difference of this rank's pieces from the saved whole tensors (nan: absent)."""
    out = {}
    for key, (shape, parts) in mine.items():
        if key not in saved or tuple(saved[key].shape) != shape:
            out[key] = float("nan")
            continue
        out[key] = max([(t.double() - saved[key][_where(o, t)].double()).abs().max().item() if t.numel() else 0.0
                        for o, t in parts], default=0.0)
    return out


# ---------------------------------------------------------------------------------------------
# Fixture writer (old code) and loader (new code)


def write_fixture(rank: int, world_size: int, out: str) -> dict:
    """Train SAVED_AT steps against the reference, then save our checkpoint and (rank 0) the reference."""
    import sharders

    dmp, keyed = sharded(world_size)
    reference = Reference()
    compare(dmp, reference.model, NAMES, "before training", atol=0.0)
    diffs = train(dmp, reference, rank, world_size, range(SAVED_AT))
    checkpoint.save(out, dmp, keyed, {"step": SAVED_AT})
    kernels = kernel_tables(dmp)
    gathered, held = [None] * world_size, [None] * world_size
    dist.all_gather_object(gathered, kernels)
    dist.all_gather_object(held, pieces(dmp, keyed))
    if rank == 0:
        saved = reference.state()
        saved.update(kernels_by_rank=gathered, old_tensors=assemble(held), kinds=kernel_kinds(dmp), train_diffs=diffs,
                     settings=[(cls.__name__, kw) for cls, kw in SETTINGS], names=NAMES,
                     sharding_type=SHARDING_TYPE, world_size=world_size)
        torch.save(saved, Path(out) / REFERENCE_FILE)
    dist.barrier()
    return {"diffs": diffs, "kernels": kernels, "describe": sharders.describe(dmp),
            "state_keys": sorted(keyed.state_dict()["state"]), "module_files": library_files()}


def library_files() -> list[str]:
    """The files of every imported overlap_optim and sharders module (which tree the code came from)."""
    return sorted(m.__file__ for name, m in list(sys.modules.items())
                  if name.split(".")[0] in ("overlap_optim", "sharders") and getattr(m, "__file__", None))


def load_and_continue(rank: int, world_size: int, fixture: str) -> dict:
    """Build with another seed, load the fixture, compare, then train STEPS - SAVED_AT steps."""
    dmp, keyed = sharded(world_size, seed=MODEL_SEED + 1)  # other weights before the load
    reference = Reference(seed=MODEL_SEED + 1)
    saved = torch.load(Path(fixture) / REFERENCE_FILE, weights_only=False)
    reference.load(saved)
    before_load = max_diff(dmp, reference.model)
    extras = checkpoint.load(fixture, dmp, keyed)
    loaded_diff = max_diff(dmp, reference.model)
    loaded_exact = mismatches(pieces(dmp, keyed), saved["old_tensors"])
    compare(dmp, reference.model, NAMES, "after load", atol=1e-7)
    loaded_state = state_diffs(keyed, reference)
    start = reference.weights()
    diffs = train(dmp, reference, rank, world_size, range(SAVED_AT, STEPS))
    end = reference.weights()
    moved = {n: (end[n] - start[n]).abs().max().item() for n in start if not n.startswith("dense.2.")}  # no optimizer
    return {
        "step": extras["step"], "before_load": before_load, "loaded_diff": loaded_diff,
        "loaded_exact": loaded_exact, "old_keys": sorted(saved["old_tensors"]), "loaded_state": loaded_state,
        "diffs": diffs, "moved": moved, "kernels": kernel_tables(dmp), "kinds": kernel_kinds(dmp),
        "saved": {k: saved[k] for k in ("kernels_by_rank", "kinds", "names", "settings", "sharding_type",
                                        "world_size", "steps")},
    }
