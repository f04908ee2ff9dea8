"""overlap_optim.checkpoint: exact resume, atomic saves, and loads that fail without changing anything."""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _models import TinyModel, assert_moved, assert_same_params, clone_params, loss_of, make_batch
from overlap_optim import apply_optimizer_in_backward, checkpoint, get_optimizers
from overlap_optim.checkpoint import CheckpointError

HERE = Path(__file__).resolve().parent


def _annotated(seed: int = 0, table_optimizer=torch.optim.Adam, rows_model=None) -> TinyModel:
    model = rows_model or TinyModel(seed=seed)
    apply_optimizer_in_backward(table_optimizer, model.ebc.parameters(), {"lr": 0.05})
    apply_optimizer_in_backward(torch.optim.SGD, model.dense.parameters(), {"lr": 0.05, "momentum": 0.9})
    return model


def _schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3) * 0.9**s)


def _train(model, optimizer, scheduler, generator, steps):
    for _ in range(steps):
        loss_of(model, make_batch(generator)).backward()
        optimizer.step()
        scheduler.step()


def test_resume_equals_uninterrupted_training(tmp_path):
    straight = _annotated()
    before = clone_params(straight)
    opt = get_optimizers(straight)
    _train(straight, opt, _schedule(opt), torch.Generator().manual_seed(0), 6)
    assert_moved(straight, before)

    first = _annotated()
    opt = get_optimizers(first)
    sched = _schedule(opt)
    generator = torch.Generator().manual_seed(0)
    _train(first, opt, sched, generator, 3)
    checkpoint.save(tmp_path, first, opt, {"scheduler": sched, "step": 3})

    resumed = _annotated(seed=1)
    opt = get_optimizers(resumed)
    sched = _schedule(opt)
    extras = checkpoint.load(tmp_path, resumed, opt, {"scheduler": sched})
    assert extras["step"] == 3 and sched.last_epoch == 3
    _train(resumed, opt, sched, generator, 3)
    assert_same_params(resumed, straight, 6)


def test_latest_complete_checkpoint_wins(tmp_path):
    model = _annotated()
    opt = get_optimizers(model)
    loss_of(model, make_batch(torch.Generator().manual_seed(0))).backward()
    checkpoint.save(tmp_path, model, opt)
    second = checkpoint.save(tmp_path, model, opt)
    assert second.name == "step-00000001"
    (tmp_path / "step-00000009").mkdir()  # no COMPLETE marker: a save that never finished
    (tmp_path / ".tmp-step-00000010-abc").mkdir()
    assert checkpoint.latest(tmp_path) == second


def test_a_save_killed_at_any_moment_leaves_a_loadable_latest(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    writer = subprocess.Popen(
        [sys.executable, str(HERE / "_checkpoint_writer.py"), str(tmp_path), "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        assert writer.stdout.readline().strip() == "1"  # one save done; the next is under way
        time.sleep(0.3)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    latest = checkpoint.latest(tmp_path)
    assert latest is not None
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 1e-3})
    extras = checkpoint.load(tmp_path, model, get_optimizers(model))
    # "step-00000009", or ".tmp-step-00000009-<token>": a save killed between its marker and its rename
    assert extras["step"] == int(re.search(r"step-(\d+)", latest.name).group(1)), latest.name


def _snapshot(model, opt):
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}
    return clone_params(model), state, copy.deepcopy(opt.state_dict()["param_groups"])


def _truncate(directory: Path) -> None:
    data = next(directory.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _corrupt_metadata(directory: Path) -> None:
    (directory / ".metadata").write_bytes(b"not a checkpoint")


@pytest.mark.parametrize(
    "loader, damage, match",
    [
        (lambda: _annotated(rows_model=_WiderModel()), None, r"missing keys \[.*'model.extra.weight'.*\], unexpected keys \[\]"),
        (lambda: _annotated(table_optimizer=torch.optim.SGD), None,
         r"missing keys \[\], unexpected keys \['optim.state.ebc.embedding_bags.t0.weight.exp_avg'"),
        (lambda: _annotated(rows_model=_TallerModel()), None,
         r"shape mismatch for model.ebc.embedding_bags.t0.weight: checkpoint \(12, 4\), model \(13, 4\)"),
        (_annotated, _truncate, r"cannot read checkpoint .*step-00000000"),
        (_annotated, _corrupt_metadata, r"cannot read checkpoint metadata"),
    ],
    ids=["other-model", "optimizer-mismatch", "shape", "truncated", "corrupt"],
)
def test_bad_checkpoint_raises_and_changes_nothing(tmp_path, loader, damage, match):
    source = _annotated()
    opt = get_optimizers(source)
    loss_of(source, make_batch(torch.Generator().manual_seed(0))).backward()
    saved = checkpoint.save(tmp_path, source, opt)
    if damage:
        damage(saved)
    target = loader()
    target_opt = get_optimizers(target)
    loss_of(target, make_batch(torch.Generator().manual_seed(1))).backward()  # state to protect
    weights, state, groups = _snapshot(target, target_opt)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load(tmp_path, target, target_opt)
    after_w, after_s, after_g = _snapshot(target, target_opt)
    assert all(torch.equal(after_w[k], v) for k, v in weights.items())
    assert after_s.keys() == state.keys()
    assert all(torch.equal(after_s[k][n], v) for k, s in state.items() for n, v in s.items())
    assert after_g == groups


def test_a_directory_without_a_complete_checkpoint_is_refused(tmp_path):
    model = _annotated()
    with pytest.raises(CheckpointError, match="no complete checkpoint under"):
        checkpoint.load(tmp_path, model, get_optimizers(model))


class _WiderModel(TinyModel):
    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(2, 2)


class _TallerModel(TinyModel):
    def __init__(self) -> None:
        super().__init__(rows=13)


def _fresh_annotated_with_state():
    model = _annotated()
    opt = get_optimizers(model)
    loss_of(model, make_batch(torch.Generator().manual_seed(0))).backward()
    return model, opt


def test_load_state_dict_refuses_state_missing_for_a_parameter_that_has_state():
    model, opt = _fresh_annotated_with_state()
    saved = opt.state_dict()
    dropped = {"state": {k: v for k, v in saved["state"].items() if k != "ebc.embedding_bags.t1.weight"},
               "param_groups": saved["param_groups"]}
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=r"no optimizer state for \['ebc.embedding_bags.t1.weight'\], which have "
                                         r"state here: loading it would drop that state"):
        opt.load_state_dict(dropped)
    after = _snapshot(model, opt)
    assert all(torch.equal(v, after[1][k][n]) for k, s in before[1].items() for n, v in s.items())


def test_state_missing_on_both_sides_loads():
    model = _annotated()
    opt = get_optimizers(model)
    saved = opt.state_dict()  # nothing stepped: every entry is a placeholder, and says so
    assert saved["state"] and saved["placeholders"] == sorted(saved["state"])
    opt.load_state_dict(saved)
    assert len(opt.state) == 0  # loaded as no state, as torch.optim before a first step


def test_a_refused_checkpoint_load_leaves_no_placeholder_state(tmp_path):
    model, opt = _fresh_annotated_with_state()
    checkpoint.save(tmp_path, model, opt)
    target = _annotated(table_optimizer=torch.optim.SGD)  # another optimizer: refused
    target_opt = get_optimizers(target)
    with pytest.raises(CheckpointError, match="unexpected keys"):
        checkpoint.load(tmp_path, target, target_opt)
    assert len(target_opt.state) == 0  # init_state's placeholders are gone too


@pytest.mark.parametrize("killed_after", [0, 1, 2, 3, 4])
def test_overwriting_a_checkpoint_is_atomic_whenever_the_save_dies(tmp_path, monkeypatch, killed_after):
    """The save dies after ``killed_after`` of its file-system steps (marker, set old aside, rename
    new in, remove old); the old or the new copy of the step is complete and loads."""
    model, opt = _fresh_annotated_with_state()
    checkpoint.save(tmp_path, model, opt, {"step": 5, "tag": "old"})
    loss_of(model, make_batch(torch.Generator().manual_seed(1))).backward()
    calls = []

    def dying(real):
        def step(*args, **kwargs):
            if len(calls) == killed_after:
                raise KeyboardInterrupt("killed")
            calls.append(real.__name__)
            return real(*args, **kwargs)
        return step

    monkeypatch.setattr(Path, "write_text", dying(Path.write_text))
    monkeypatch.setattr(os, "replace", dying(os.replace))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", dying(checkpoint.shutil.rmtree))
    try:
        checkpoint.save(tmp_path, model, opt, {"step": 5, "tag": "new"})
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    found = checkpoint.latest(tmp_path)
    assert found is not None
    fresh = _annotated()
    extras = checkpoint.load(tmp_path, fresh, get_optimizers(fresh))
    assert calls == ["write_text", "replace", "replace", "rmtree"][:killed_after]  # the save's own steps
    assert extras["tag"] == ("old" if killed_after < 2 else "new"), (killed_after, found.name)
    assert sorted(d.name for d in tmp_path.iterdir() if d.name.startswith("step-")) == (
        ["step-00000005"] if killed_after != 2 else [])


@pytest.mark.parametrize("form", ["checkpoint", "plain_dcp"])
def test_a_checkpoint_taken_before_the_first_step_trains_on_as_torch_optim_from_scratch(tmp_path, form):
    """Saved before any step, every entry is a placeholder (Adam's step 1 after init_state, SGD's zero
    momentum buffer) and is listed as one: loaded, it is no state. Were it loaded as state, Adam's bias
    correction and SGD's first step with dampening would differ from torch.optim's."""
    import torch.distributed.checkpoint as dcp

    def annotate(model):
        apply_optimizer_in_backward(torch.optim.Adam, model.ebc.parameters(), {"lr": 0.05})
        apply_optimizer_in_backward(torch.optim.SGD, model.dense.parameters(),
                                    {"lr": 0.05, "momentum": 0.9, "dampening": 0.5})
        return model

    first = annotate(TinyModel(seed=0))
    opt = get_optimizers(first)
    if form == "checkpoint":
        checkpoint.save(tmp_path, first, opt)
    else:
        dcp.save({"model": first.state_dict(), "optim": opt.state_dict()}, checkpoint_id=tmp_path)
    resumed = annotate(TinyModel(seed=1))
    resumed_opt = get_optimizers(resumed)
    if form == "checkpoint":
        checkpoint.load(tmp_path, resumed, resumed_opt)
    else:
        dcp.load({"model": resumed, "optim": resumed_opt}, checkpoint_id=tmp_path)
    reference = TinyModel(seed=0)
    ref_opts = [torch.optim.Adam(reference.ebc.parameters(), lr=0.05),
                torch.optim.SGD(reference.dense.parameters(), lr=0.05, momentum=0.9, dampening=0.5)]
    before = clone_params(reference)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        batch = make_batch(generator)
        loss_of(resumed, batch).backward()
        loss_of(reference, batch).backward()
        for ref_opt in ref_opts:
            ref_opt.step()
            ref_opt.zero_grad()
        assert_same_params(resumed, reference, step)
    assert_moved(reference, before)


@pytest.mark.parametrize("trained", [False, True])
def test_torchs_get_and_set_state_dict_are_refused_by_name_with_nothing_changed(trained):
    """torch.distributed.checkpoint.state_dict re-keys an optimizer's state from positions to names
    (get) and back (set); ours is keyed by name already. On the main of 2026-11-27 get_state_dict
    returned our state keyed by position, and set_state_dict failed on those keys. Both are refused,
    naming the API, fresh (where torch first puts zero gradients and steps to make state) or trained:
    no gradient is left behind, the weights and state are as they were, and a loop that never called
    step() is still not checked."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _annotated()
    optimizer = get_optimizers(model)
    generator = torch.Generator().manual_seed(0)
    if trained:
        loss_of(model, make_batch(generator)).backward()
    before, state = clone_params(model), copy.deepcopy(optimizer.state_dict())
    with pytest.raises(NotImplementedError, match="get_state_dict / set_state_dict .* keys its state by parameter FQN"):
        get_state_dict(model, optimizer)
    with pytest.raises(NotImplementedError, match="get_state_dict / set_state_dict"):
        set_state_dict(model, optimizer, model_state_dict=model.state_dict(), optim_state_dict=state)
    assert all(p.grad is None for p in model.parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name
    after = optimizer.state_dict()
    assert after["placeholders"] == state["placeholders"] and after["param_groups"] == state["param_groups"]
    for key, entry in state["state"].items():
        for name, value in entry.items():
            assert torch.equal(after["state"][key][name], value), (key, name)
    for _ in range(2):  # no step() ever called: no "found no step()" check
        loss_of(model, make_batch(generator)).backward()
