"""FSDP2 for the dense part (overlap_optim/fsdp.py): 2 ranks, gloo, against one process of torch.optim.

Reference: the unsharded MLP, the global batch, ``torch.optim`` as a user builds it, compared after
every step. The MLP's layers have 5, 3 and 1 rows: none divides by 2 ranks, the last leaves rank 1
an empty shard.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

import overlap_optim
from overlap_optim.testing import run_cases, selected_cases
from _fsdp_bodies import (
    VECTORS, _batch, _loss, accumulated, checkpoint_to_ddp, clipped, dmp_with_fsdp, grouped, layerwise, layerwise_vectors,
    biases_of, parity, reference_after, scheduled, sharded_pair, torch_fully_shard, unused, weights_of,
)
from test_parity_single_process import CASES

# Rprop: element-wise with no virtual group; torch.optim's own step on FSDP2's DTensors crashed in backward
# (its masked assignment has no DTensor rule): it steps each shard with its own class (placements.PieceStep).
PARITY = {f"parity/{name}": partial(parity, weights=(cls, kwargs))
          for name, cls, kwargs in [*CASES, ("rprop", torch.optim.Rprop, {"lr": 0.01})]}
# the weights' optimizer of each checkpoint case, and after a "+" the biases' (else Adam)
CHECKPOINTS = ("adam", "adafactor", "lamb", "muon", "adafactor+adafactor", "adam+came", "adam+lars")
LAYERWISE = {f"layerwise/{name}": partial(layerwise, name=name)
             for name in ("adafactor", "came", "lamb", "lars", "muon", "muon_settings", "galore")}
# Every parameter, biases included, with a layer-wise optimizer; the mutation of each that has vector statistics.
ON_VECTORS = {f"vectors/{name}": partial(layerwise_vectors, name=name) for name in VECTORS}
VECTOR_MUTATIONS = {f"vectors/{name}/no_statistics": partial(layerwise_vectors, name=name, statistics=False)
                    for name in ("adafactor", "came", "lamb")}
# The same with the state kept in BF16 (state_dtype=): each step's float32 working copies live across the round.
BF16_STATE = {f"vectors/{name}/bf16_state": partial(layerwise_vectors, name=name, state_dtype=torch.bfloat16)
              for name in VECTORS}
RANK_CASES = {**PARITY, **LAYERWISE, **ON_VECTORS, **BF16_STATE, **VECTOR_MUTATIONS, "layerwise/adafactor/no_statistics": partial(layerwise, name="adafactor",
                                                                                  statistics=False),
              "layerwise/galore/no_statistics": partial(layerwise, name="galore", statistics=False),
              "grouped": grouped, "accumulated/adafactor": partial(accumulated, weights="adafactor"),
              "clipped/norm": partial(clipped, how={"max_norm": 0.05}),
              "clipped/value": partial(clipped, how={"clip_value": 0.01}),
              "clipped/layerwise": partial(clipped, how={"max_norm": 0.05}, weights="adafactor"),
              "clipped/muon": partial(clipped, how={"max_norm": 0.05}, weights="muon"), "unused": unused, "dmp": dmp_with_fsdp, "scheduled": scheduled, "accumulated": accumulated, "torch_fully_shard": torch_fully_shard}


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    return {f"checkpoint/{w}": tmp_path_factory.mktemp(f"fsdp_checkpoint_{w}") for w in CHECKPOINTS}


@pytest.fixture(scope="module")
def ranks(request, directories):
    cases = {**RANK_CASES, **{case: partial(checkpoint_to_ddp, directory=str(directory), weights=case.split("/")[1])
                              for case, directory in directories.items()}}
    return run_cases(cases, selected_cases(request, cases), timeout=600)


@pytest.mark.parametrize("case", PARITY)
def test_each_shard_steps_in_backward_exactly_as_torch_optim_on_the_whole(ranks, case):
    for out in ranks[case]:
        assert max(out["diffs"]) < 1e-6, out["diffs"]
        assert out["moved"] > 1e-3, out  # the reference moved every parameter
        assert out["grads_left"] == [], out  # each gradient released after its step
        assert out["unsharded_outlived"] == 0, out  # freed at once, not at the next garbage collection
    assert [r["local_rows"] for r in ranks[case]] == [[3, 3, 2, 2, 1, 1], [2, 2, 1, 1, 0, 0]]


@pytest.mark.parametrize("case", LAYERWISE)
def test_layerwise_optimizers_step_across_fsdp_shards_exactly(ranks, case):
    for out in ranks[case]:
        assert max(out["diffs"]) < 1e-5, out["diffs"]
        assert out["moved"] > 1e-4, out
        assert out["all_reduces_per_step"] == 1, out  # one round for the 3 weights


@pytest.mark.parametrize("case", ON_VECTORS)
def test_layerwise_optimizers_step_biases_across_fsdp_shards_exactly(ranks, case):
    """Biases of 5, 3 and 1 elements: rank 1 holds 2, 1 and none, and still takes part in the round."""
    assert [out["bias_rows"] for out in ranks[case]] == [[3, 2, 1], [2, 1, 0]]
    for out in ranks[case]:
        assert max(out["diffs"]) < 1e-5, out["diffs"]
        assert out["moved"] > 1e-4, out  # every parameter, more than 3x the tolerance
        assert out["all_reduces_per_step"] == 1, out  # one round for the 3 weights and the 3 biases
        # the reference's state names (and the counters it keeps in its group) and global shapes, its values
        assert out["state_names"] == [] and out["state_shapes"] == [], out
        assert out["state_diff"] < 1e-5, out
        # the per-element state of a bias is sharded as the bias is
        assert {kind for _, _, kind in out["vector_state"]} == {"DTensor"}, out["vector_state"]


@pytest.mark.parametrize("case", BF16_STATE)
def test_layerwise_optimizers_keep_bf16_state_across_fsdp_shards_exactly(ranks, case):
    """The reference rounds each state tensor to BF16 after each step; ours keeps it in BF16."""
    for out in ranks[case]:
        assert max(out["diffs"]) < 1e-5, out["diffs"]
        assert out["moved"] > 1e-4, out
        assert out["all_reduces_per_step"] == 1, out
        assert out["state_names"] == [] and out["state_shapes"] == [], out
        assert out["state_diff"] < 1e-5, out
        assert out["state_dtypes"] == ["torch.bfloat16"], out["state_dtypes"]


@pytest.mark.parametrize("case", VECTOR_MUTATIONS)
def test_without_the_cross_shard_statistics_the_biases_are_wrong(ranks, case):
    """The mutation the bias test must catch: each shard of a bias on its own sums."""
    assert max(max(out["bias_diffs"]) for out in ranks[case]) > 1e-4, [out["bias_diffs"] for out in ranks[case]]


@pytest.mark.parametrize("case", ["layerwise/adafactor/no_statistics", "layerwise/galore/no_statistics"])
def test_without_the_cross_shard_statistics_the_layerwise_step_is_wrong(ranks, case):
    """The mutation the parity test must catch: each shard on its own sums (GaLore: its projection of
    its own rows, zeros elsewhere)."""
    for out in ranks[case]:
        assert out["all_reduces_per_step"] == 0, out
    assert max(max(out["diffs"]) for out in ranks[case]) > 1e-4, [out["diffs"] for out in ranks[case]]


@pytest.mark.parametrize("case", ["clipped/norm", "clipped/value", "clipped/layerwise", "clipped/muon"])
def test_clipping_over_fsdp_shards_equals_torch_clipping_on_the_whole(ranks, case):
    for out in ranks[case]:
        assert max(out["diffs"]) < 1e-5, out["diffs"]
        # the bound binds at every step (the global norm, or the largest |g|, passes it)
        assert len(out["norms"]["torch"]) == 3 and all(n > 0.05 for n in out["norms"]["torch"]), out
        if case != "clipped/value":  # ours' global norm, over both ranks' shards, is torch's
            assert out["norms"]["ours"] == pytest.approx(out["norms"]["torch"], rel=1e-5), out


@pytest.mark.parametrize("case", ["grouped"])
def test_each_fsdp_group_steps_in_one_multi_tensor_update(ranks, case):
    for out in ranks[case]:
        assert max(out["diffs"]) < 1e-6, out["diffs"]
        # per step, per layer (an FSDP group): its weight and bias, two learning rates, one update
        assert out["sizes"] == [2, 2, 2] * 2, out["sizes"]


@pytest.mark.parametrize("case", ["unused"])
def test_a_group_with_an_unused_parameter_steps_the_rest_when_backward_ends(ranks, case):
    for out in ranks[case]:
        assert max(out["diffs"]) < 1e-6, out["diffs"]


@pytest.mark.parametrize("case", ["dmp"])
def test_sharded_tables_and_an_fsdp_dense_part_train_exactly_under_one_optimizer(ranks, case):
    for out in ranks[case]:  # compared after every step in the ranks
        assert out["dense_types"] == ["DTensor"], out
        assert out["keys"] == ["dense.0.bias", "dense.0.weight", "dense.2.bias", "dense.2.weight",
                               "ebc.embedding_bags.t0.weight", "ebc.embedding_bags.t1.weight",
                               "ebc.embedding_bags.t2.weight"], out["keys"]
        assert min(out["moved"].values()) > 1e-3, out["moved"]


@pytest.mark.parametrize("case", ["scheduled"])
def test_a_scheduler_on_get_optimizers_reaches_the_shards(ranks, case):
    for out in ranks[case]:
        assert max(out["diffs"]) < 1e-6, out["diffs"]
        assert out["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"], out
        assert out["state_types"] == ["DTensor"], out  # each rank's state is its shard's


@pytest.mark.parametrize("case", ["accumulated", "accumulated/adafactor"])
def test_no_step_accumulates_unsharded_and_steps_once_on_the_sum(ranks, case):
    for out in ranks[case]:
        assert max(out["diffs"]) < 1e-6, out["diffs"]
        # one reduce-scatter per FSDP group (3 layers) per step: none in the no_step micro-batches
        assert out["reduce_scatters_per_step"] == 3, out


@pytest.mark.parametrize("case", ["torch_fully_shard"])
def test_annotated_parameters_sharded_by_torch_are_refused(ranks, case):
    for out in ranks[case]:
        assert "overlap_optim.fully_shard" in out["theirs"] and "6 annotated parameter(s)" in out["theirs"], out
        assert "'0.weight' (5, 6) (Adam)" in out["theirs"], out
        assert len(out["ours"]) == 6, out
        # a loop that never calls get_optimizers: refused at each forward, nothing changed
        errors, changed = out["loop"]["errors"], out["loop"]["changed"]
        assert all(e is not None and "6 annotated parameter(s)" in e for e in errors) and changed == [], out
        # overlap_optim.fully_shard's model trains in that loop
        assert out["ours_loop"]["errors"] == [None, None] and len(out["ours_loop"]["changed"]) == 6, out


@pytest.mark.parametrize("case", [f"checkpoint/{w}" for w in CHECKPOINTS])
def test_a_checkpoint_saved_under_fsdp_loads_under_ddp_and_fsdp(ranks, case):
    for out in ranks[case]:
        assert set(out) == {"ddp", "fsdp", "ddp_to_fsdp"}, out
        for target, (loaded, after_a_step, step) in out.items():
            assert loaded < 1e-6 and after_a_step < 1e-5 and step == 2, (target, out)


@pytest.mark.parametrize("case", [f"checkpoint/{w}" for w in CHECKPOINTS])
def test_a_checkpoint_saved_under_fsdp_on_2_ranks_loads_in_one_process(ranks, case, directories):
    ranks[case]  # saved by the ranks
    weights, biases = weights_of(case.split("/")[1]), biases_of(case.split("/")[1])
    model = sharded_pair(weights, seed=1, biases=biases)[0]  # another start: the load must replace it
    overlap_optim.checkpoint.load(directories[case], model, overlap_optim.get_optimizers(model))
    reference, ref_opts = reference_after(2, world_size=2, weights=weights, biases=biases)
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())) < 1e-6
    x, y = _batch(2, world_size=2)  # one more step on the global batch, in one process
    _loss(model, x, y).backward()
    _loss(reference, x, y).backward()
    for opt in ref_opts:
        opt.step()
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())) < 1e-5


# -- refused before anything is sharded (one process) --


def _annotated(cls=torch.optim.Adam, kwargs=None):
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))
    overlap_optim.apply_optimizer_in_backward(cls, model.parameters(), kwargs or {"lr": 0.05})
    return model


def test_muon_on_a_vector_is_refused_naming_the_parameter():
    """As torch's Muon refuses it: when annotated, before fully_shard."""
    with pytest.raises(ValueError, match=r"params\[1\] \(shape \(5,\)\) is 1-D, and Muon does not step 1-D.*2D"):
        overlap_optim.fully_shard(_annotated(torch.optim.Muon))


def test_a_layerwise_optimizer_on_a_3d_parameter_is_refused_naming_the_parameter():
    model = nn.Module()
    model.kernel = nn.Parameter(torch.randn(4, 3, 2))
    overlap_optim.apply_optimizer_in_backward(torch.optim.Adafactor, model.parameters(), {"lr": 0.05})
    with pytest.raises(ValueError, match=r"parameter 'kernel' \(shape \(4, 3, 2\)\) is annotated with Adafactor.*"
                                         r"on a 1-D or 2-D parameter"):
        overlap_optim.fully_shard(model)


def test_an_optimizer_without_a_cross_shard_form_is_refused_naming_the_parameter():
    from pytorch_optimizer import AdamP  # its projection reads cosines of rows and of the whole weight

    with pytest.raises(ValueError, match=r"parameter '0.weight' \(shape \(5, 6\)\) is annotated with AdamP.*no cross"):
        model = nn.Sequential(nn.Linear(6, 5, bias=False))
        overlap_optim.apply_optimizer_in_backward(AdamP, model.parameters(), {"lr": 0.05})
        overlap_optim.fully_shard(model)


def test_cpu_offload_is_refused():
    from torch.distributed.fsdp import CPUOffloadPolicy

    with pytest.raises(ValueError, match="offload_policy=CPUOffloadPolicy"):
        overlap_optim.fully_shard(_annotated(), offload_policy=CPUOffloadPolicy())


@pytest.mark.parametrize("setting", ["param_dtype", "reduce_dtype"])
def test_mixed_precision_that_casts_is_refused(setting):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    with pytest.raises(ValueError, match=f"mp_policy {setting}=torch.bfloat16"):
        overlap_optim.fully_shard(_annotated(), mp_policy=MixedPrecisionPolicy(**{setting: torch.bfloat16}))


def test_a_3d_mesh_is_refused():
    """1-D meshes shard, 2-D ones are HSDP (tests/test_tensor_parallel.py); 3-D ones are refused."""
    from types import SimpleNamespace

    mesh = SimpleNamespace(ndim=3)  # only its shape is read before refusing: no process group needed
    with pytest.raises(ValueError, match="has 3 dimensions"):
        overlap_optim.fully_shard(_annotated(), mesh=mesh)


def test_fully_shard_takes_a_module():
    with pytest.raises(TypeError, match="got list"):
        overlap_optim.fully_shard([nn.Linear(2, 2)])
