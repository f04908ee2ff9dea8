"""Rank bodies for the frozen-table tests (spawned; not collected by pytest)."""

from __future__ import annotations

import torch

import overlap_optim
import sharders
from _models import concat_batches, covering_batch, loss_of
from _sharded_parity import build, compare, local_pieces

NAMES = ["frozen", "fused", "fallback"]
SETTINGS = [
    (torch.optim.SGD, {"lr": 0.5}),  # annotated, then frozen: frozen wins
    (torch.optim.Adagrad, {"lr": 0.2}),
    (torch.optim.Adagrad, {"lr": 0.2, "lr_decay": 0.1}),  # the fallback; lazy equals dense for Adagrad
]
DENSE = (torch.optim.Adam, {"lr": 0.01})


def frozen_table(rank: int, world_size: int, sharding_type: str, steps: int = 3) -> dict:
    """A table annotated with SGD and then frozen, beside a fused and a fallback table and the MLP,
    trained 3 steps on batches that touch only some rows, against torch.optim on the global batch.

    Returns what the test asserts: the frozen table's largest change (must be 0, bitwise), how far
    the reference moved the others, the describe() rows, the state keys, and the refusal raised
    when the frozen weight is made trainable again."""
    freeze = _freezing_build(world_size, sharding_type)
    dmp, reference, ref_opts = freeze
    start = {n: [p.clone() for _, _, p in local_pieces(dmp, n)] for n in NAMES}
    ref_start = {n: reference.ebc.embedding_bags[n].weight.detach().clone() for n in NAMES}
    keyed = overlap_optim.get_optimizers(dmp)
    user = torch.optim.SGD([p for n, p in dmp.named_parameters() if n.startswith("dense.2.")], lr=0.1)
    ref_user = torch.optim.SGD(reference.dense[2].parameters(), lr=0.1)
    frozen_moved = 0.0
    for step in range(steps):
        generator = torch.Generator().manual_seed(300 + step)
        parts = [covering_batch(NAMES, generator, cover=False) for _ in range(world_size)]
        loss_of(dmp, parts[rank]).backward()
        keyed.step()
        user.step()
        user.zero_grad()
        loss_of(reference, concat_batches(parts)).backward()
        for opt in ref_opts + [ref_user]:
            opt.step()
        reference.zero_grad()
        compare(dmp, reference, NAMES, step)
        for piece, before in zip((p for _, _, p in local_pieces(dmp, "frozen")), start["frozen"]):
            frozen_moved = max(frozen_moved, (piece - before).abs().max().item())
            assert torch.equal(piece, before), f"step {step}: the frozen table changed"
    moved = {n: (reference.ebc.embedding_bags[n].weight.detach() - ref_start[n]).abs().max().item() for n in NAMES}
    rows = [line for line in sharders.describe(dmp).splitlines() if "frozen" in line]
    state_keys = sorted(keyed.state_dict()["state"])
    plan = sharders.plan_of(dmp.module.ebc)
    kinds = {name: table.kind.value for name, table in plan.tables.items()}
    unoptimized = sorted(overlap_optim.unoptimized_parameters(dmp))
    dmp.module.ebc.embedding_bags["frozen"].weight.requires_grad_(True)
    try:
        loss_of(dmp, covering_batch(NAMES, torch.Generator().manual_seed(9))).backward()
        refusal = ""
    except ValueError as err:
        refusal = str(err)
    return {"frozen_moved": frozen_moved, "moved": moved, "describe": rows, "state_keys": state_keys,
            "kinds": kinds, "unoptimized": unoptimized, "refusal": refusal}


def _freezing_build(world_size: int, sharding_type: str):
    """``build`` with the "frozen" table frozen (requires_grad=False) after its annotation, on
    our model and on the reference (whose SGD then never steps it, as torch.optim does)."""
    original = sharders.EmbeddingBagCollectionSharder.shard

    def shard(self, module, *args, **kwargs):
        module.embedding_bags["frozen"].weight.requires_grad_(False)
        return original(self, module, *args, **kwargs)

    sharders.EmbeddingBagCollectionSharder.shard = shard
    try:
        dmp, reference, ref_opts = build(NAMES, SETTINGS, sharding_type, world_size, dense=DENSE)
    finally:
        sharders.EmbeddingBagCollectionSharder.shard = original
    reference.ebc.embedding_bags["frozen"].weight.requires_grad_(False)
    return dmp, reference, ref_opts
