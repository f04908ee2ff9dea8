"""Every private torch (and TorchRec) API the core touches, each in one place, each named and checked.

torch does not promise these across releases. Each is reached only through the
functions of this module, so an upgrade that removes one breaks one function,
and ``tests/test_private_apis.py`` names it: it checks every entry of
:data:`PRIVATE_APIS` against the installed torch. Two TorchRec names the core
needs without importing ``sharders`` sit here too (``saves_param_groups``,
``DMP_WRAPPED``); ``sharders/_private.py`` holds the rest of TorchRec's.

The sharded-tensor names (``Shard``, ``ShardedTensor``, ...) live in
``torch.distributed._shard``, a private package; they are re-exported from here
so that no other module imports it.
"""

from __future__ import annotations

import contextlib
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.optim.apply_optimizer_in_backward as _torch_in_backward
from torch.autograd import Variable
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.nn.parallel import DistributedDataParallel
from torch.optim import _muon
from torch.utils import _pytree
from torch.utils.hooks import RemovableHandle

__all__ = [
    "PRIVATE_APIS",
    "dtensor_piece",
    "splits",
    "queue_end_of_backward",
    "backward_id",
    "ddp_managed_parameters",
    "skip_ddp_lazy_init",
    "no_sync_unless_first_static",
    "tell_reducer_optimizer_in_backward",
    "in_backward_hook_handles",
    "add_in_backward_hook_handle",
    "pop_in_backward_hook_handles",
    "hook_handle_alive",
    "sharded_tensor_from_local_shards",
    "sharded_tensor_process_group",
    "foreach",
    "fused",
    "fsdp_taken",
    "label_fsdp_uid",
    "fsdp_uid_label",
    "tree_leaves",
    "tensor_version",
    "module_parameters",
    "muon_orthogonalized",
    "muon_adjusted_lr",
    "saves_param_groups",
    "DMP_WRAPPED",
    "called_from_torch_state_dict_api",
    "torchrec_holds_step",
    "compiling_pipeline",
    "Shard",
    "ShardedTensor",
    "ShardedTensorMetadata",
    "ShardMetadata",
    "TensorProperties",
]


# -- the autograd engine --


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass ends.

    Private API: ``Variable._execution_engine.queue_callback`` (torch's own
    in-backward DDP path and FSDP use it; no public equivalent in torch 2.13).
    Call it from inside backward only.
    """
    Variable._execution_engine.queue_callback(callback)


def backward_id() -> int:
    """An id of the running backward pass, different for each; -1 outside backward.

    Private API: ``torch._C._current_graph_task_id``. It tells a callback queued
    by a backward that raised before its end (so it never ran) from the running one.
    """
    return torch._C._current_graph_task_id()


# -- DistributedDataParallel --


def ddp_managed_parameters(ddp_model: DistributedDataParallel) -> list[torch.nn.Parameter]:
    """The parameters DDP reduces, in its order (those it was told to ignore left out).

    Private API: ``DistributedDataParallel._module_parameters``.
    """
    return ddp_model._module_parameters


def skip_ddp_lazy_init(ddp_model: DistributedDataParallel) -> None:
    """Keep DDP from running its lazy init at the first forward.

    Private API: ``DistributedDataParallel._lazy_init_ran``. The lazy init only
    installs torch's own in-backward hook for parameters that carry
    ``_in_backward_optimizers``, which crashes on CPU and cannot be combined with
    another comm hook; marking it done skips it.
    """
    ddp_model._lazy_init_ran = True


def tell_reducer_optimizer_in_backward(ddp_model: DistributedDataParallel) -> None:
    """Tell DDP's reducer that an optimizer consumes the gradients in backward.

    Private API: ``Reducer._set_optimizer_in_backward``. The reducer then
    rebuilds a gradient released to None from its bucket at every step, and no
    longer copies the bucket into ``param.grad`` itself.
    """
    ddp_model.reducer._set_optimizer_in_backward()


def no_sync_unless_first_static(ddp: DistributedDataParallel) -> contextlib.AbstractContextManager:
    """``ddp.no_sync()``, except before the first backward of a static-graph DDP (TorchRec builds
    them so): that backward's delayed all-reduce runs whatever ``no_sync`` says, and asserts
    under it (``expect_autograd_hooks_`` in reducer.cpp). Then nothing: the comm hook keeps
    that backward's gradients local itself.

    Private API: ``DistributedDataParallel._static_graph_delay_allreduce_enqueued``, set at the
    end of a static-graph DDP's first backward.
    """
    if ddp.static_graph and not ddp._static_graph_delay_allreduce_enqueued:
        return contextlib.nullcontext()
    return ddp.no_sync()


def _probe_ddp() -> DistributedDataParallel:
    """A one-layer DDP model, to check DDP's instance attributes (needs the default process group)."""
    return DistributedDataParallel(torch.nn.Linear(1, 1))


# -- torch's in-backward annotation --


def in_backward_hook_handles(param: torch.Tensor) -> list[RemovableHandle]:
    """The in-backward hook handles registered for ``param`` (empty if none).

    Private API: ``torch.distributed.optim.apply_optimizer_in_backward.param_to_optim_hook_handle_map``,
    the registry torch's ``_apply_optimizer_in_backward`` fills and DDP's lazy
    init empties (removing each hook) before it installs its own.
    """
    return _torch_in_backward.param_to_optim_hook_handle_map.get(param, [])


def add_in_backward_hook_handle(param: torch.Tensor, handle: RemovableHandle) -> None:
    """Record ``handle`` in torch's registry (see :func:`in_backward_hook_handles`), so that
    DDP's lazy init finds and removes it as it removes torch's own."""
    _torch_in_backward.param_to_optim_hook_handle_map.setdefault(param, []).append(handle)


def pop_in_backward_hook_handles(param: torch.Tensor) -> list[RemovableHandle]:
    """Take ``param``'s handles out of torch's registry (see :func:`in_backward_hook_handles`)."""
    return _torch_in_backward.param_to_optim_hook_handle_map.pop(param, [])


def hook_handle_alive(handle: RemovableHandle) -> bool:
    """Whether the hook of ``handle`` is still registered (no one removed it).

    Undocumented API: ``RemovableHandle.hooks_dict_ref`` and ``RemovableHandle.id``
    (torch has no public way to ask a handle whether it was removed).
    """
    hooks = handle.hooks_dict_ref()
    return hooks is not None and handle.id in hooks


def _probe_handle() -> tuple[Any, int]:
    handle = RemovableHandle(OrderedDict())  # what Module and Tensor keep their hooks in
    return handle.hooks_dict_ref, handle.id


def _annotation_contract() -> tuple[str, ...]:
    """The attribute names torch's ``_apply_optimizer_in_backward`` sets on a parameter.

    Private API: ``torch.distributed.optim._apply_optimizer_in_backward``. We set
    the same names (``_optimizer_classes``, ``_optimizer_kwargs``,
    ``_in_backward_optimizers``) and TorchRec's sharders read them: a contract.
    Raises AttributeError when torch no longer sets one of them.
    """
    param = torch.nn.Parameter(torch.zeros(1))
    _torch_in_backward._apply_optimizer_in_backward(torch.optim.SGD, [param], {"lr": 0.1}, register_hook=False)
    names = ("_optimizer_classes", "_optimizer_kwargs", "_in_backward_optimizers")
    missing = [name for name in names if not hasattr(param, name)]
    if missing:
        raise AttributeError(f"_apply_optimizer_in_backward no longer sets {missing} on a parameter")
    return names


# -- ShardedTensor (torch.distributed._shard) --


def sharded_tensor_from_local_shards(
    local_shards: list[Shard], metadata: ShardedTensorMetadata, process_group: dist.ProcessGroup | None
) -> ShardedTensor:
    """A ShardedTensor made of this rank's ``local_shards``, described by the global ``metadata``.

    Private API: ``ShardedTensor._init_from_local_shards_and_global_metadata``
    (the public ``init_from_local_shards`` gathers the metadata across ranks, a
    collective; here every rank knows it already).
    """
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, metadata, process_group=process_group
    )


def sharded_tensor_process_group(tensor: ShardedTensor) -> dist.ProcessGroup | None:
    """The process group ``tensor`` is sharded over.

    Private API: ``ShardedTensor._process_group`` (no public accessor).
    """
    return tensor._process_group


def _probe_sharded_tensor() -> ShardedTensor:
    """A ShardedTensor of one shard on this rank (needs a default process group of one rank)."""
    shard = ShardMetadata(shard_offsets=[0], shard_sizes=[2], placement=f"rank:{dist.get_rank()}/cpu")
    metadata = ShardedTensorMetadata(
        shards_metadata=[shard], size=torch.Size([2]), tensor_properties=TensorProperties(dtype=torch.float32)
    )
    return sharded_tensor_from_local_shards([Shard(torch.zeros(2), shard)], metadata, dist.group.WORLD)


# -- multi-tensor (foreach) kernels --

_FOREACH_OPS = (
    "abs", "add", "add_", "addcdiv_", "addcmul", "addcmul_", "clamp_max_", "clamp_min_", "div", "div_", "lerp_",
    "maximum_", "mul", "mul_", "neg", "norm", "sqrt", "sqrt_",
)


class _Foreach:
    """``foreach.mul_`` is ``torch._foreach_mul_``, and so on for every op of ``_FOREACH_OPS``.

    Private API: ``torch._foreach_*``, torch's multi-tensor kernels (what
    ``torch.optim``'s ``foreach`` implementations call; no public equivalent).
    Each op is looked up on ``torch`` at each use, as ``torch._foreach_mul_``
    written in place would be, so that a patched torch op (``mock.patch``) is
    the one called; the lookup costs little beside the op.
    An op not listed raises AttributeError.
    """

    __slots__ = ()


def _late_bound(name: str) -> property:
    return property(lambda self: getattr(torch, name), doc=f"``torch.{name}``")


for _op in _FOREACH_OPS:
    setattr(_Foreach, _op, _late_bound(f"_foreach_{_op}"))

foreach: Any = _Foreach()


def _foreach_entry(op: str) -> Callable[[], object]:
    return lambda: getattr(torch, f"_foreach_{op}")


# -- fused optimizer kernels --

_FUSED_OPS = ("adam_", "adamw_", "sgd_", "adagrad_")


class _Fused:
    """``fused.adam_`` is ``torch._fused_adam_``, and so on for every op of ``_FUSED_OPS``.

    Private API: ``torch._fused_*``, torch's fused optimizer kernels (what ``torch.optim``'s
    ``fused=True`` implementations call; no public equivalent that takes a state it does not
    own). Looked up on ``torch`` at each use, as :data:`foreach` is.
    """

    __slots__ = ()


for _op in _FUSED_OPS:
    setattr(_Fused, _op, _late_bound(f"_fused_{_op}"))
del _op

fused: Any = _Fused()


# name -> a function that returns the private object (raises if it is gone).
# The probes of instance attributes build a tiny DDP model or ShardedTensor: they
# need torch.distributed initialized (the test makes a world-size-1 gloo group).
# -- FSDP2 --


def fsdp_taken(module: torch.nn.Module) -> list[tuple[int, torch.Tensor]]:
    """``(FSDP2's id of the original parameter, the sharded parameter that replaced it)`` for each
    parameter that ``fully_shard`` took from ``module`` (an ``FSDPModule``). Private:
    ``fully_shard.state(module)._fsdp_param_groups``, each group's ``fsdp_params`` and their
    ``_orig_param_uid`` and ``sharded_param``."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)
    return [(p._orig_param_uid, p.sharded_param) for group in state._fsdp_param_groups for p in group.fsdp_params]


class _LabelledUid(int):
    """FSDP2's id of a parameter that carries a label (what overlap_optim annotated it with)."""

    label: str

    def __new__(cls, uid: int, label: str) -> _LabelledUid:
        made = super().__new__(cls, uid)
        made.label = label
        return made

    def __reduce__(self) -> tuple[type, tuple[int, str]]:  # copy.deepcopy and pickle keep the label
        return type(self), (int(self), self.label)


def label_fsdp_uid(param: torch.Tensor, label: str) -> None:
    """Give ``param`` now the id FSDP2 gives it if ``fully_shard`` takes it, carrying ``label``.

    FSDP2 keeps an id it finds on the parameter, and keeps that very object in its record of the
    parameter it replaced (``FSDPParam._orig_param_uid``), on the module: so the label outlives the
    replaced parameter (:func:`fsdp_uid_label` reads it from :func:`fsdp_taken`), and no table of
    ids is kept. Private: ``_fsdp_param._get_orig_param_uid``, which sets ``param._fsdp_orig_uid``
    from FSDP2's own counter."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    param._fsdp_orig_uid = _LabelledUid(_fsdp_param._get_orig_param_uid(param), label)


def fsdp_uid_label(uid: int) -> str | None:
    """The label :func:`label_fsdp_uid` gave FSDP2's id ``uid``, or None."""
    return uid.label if isinstance(uid, _LabelledUid) else None


def _fsdp_contract() -> object:
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_state

    probe = torch.nn.Parameter(torch.zeros(1))
    _fsdp_param._get_orig_param_uid(probe)
    assert "_fsdp_orig_uid" in probe.__dict__, "FSDP2 no longer marks the original parameter"
    assert "_orig_param_uid" in _fsdp_param.FSDPParam.__annotations__, "FSDPParam._orig_param_uid is gone"
    assert "sharded_param" in _fsdp_param.FSDPParam.__annotations__, "FSDPParam.sharded_param is gone"
    label_fsdp_uid(probe, "probe")
    assert fsdp_uid_label(_fsdp_param._get_orig_param_uid(probe)) == "probe", "FSDP2 no longer keeps the id it finds"
    assert isinstance(_fsdp_state.FSDPState()._fsdp_param_groups, list), "FSDPState._fsdp_param_groups is gone"
    return probe


# -- torch.nn.Module, tensors, pytrees --


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of a nest of lists, tuples and dicts (a module's output), in order.

    Private API: ``torch.utils._pytree.tree_leaves`` (torch's own nests, dataclasses of
    registered types included; no public equivalent).
    """
    return _pytree.tree_leaves(tree)


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: every in-place write bumps it. Private API: ``Tensor._version``."""
    return tensor._version


def _probe_version() -> int:
    tensor = torch.zeros(1)
    before = tensor._version
    tensor.add_(1)
    assert tensor._version > before, "Tensor._version no longer counts in-place writes"
    return before


def module_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """The dict ``module`` keeps its own parameters in, by name (None where one was set to None),
    without its submodules'. Private API: ``nn.Module._parameters``."""
    return module.__dict__["_parameters"]


def dtensor_piece(param: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(this rank's local shape, its offset in the whole)`` of DTensor ``param``, for any placements
    (FSDP2's strided shards over tensor parallelism's included): each piece is one block of the whole.
    Private: ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(shape), tuple(offset)


def _probe_strided_shard() -> object:
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(0, split_factor=2)


def splits(placement: Any) -> bool:
    """Whether a DTensor placement splits its tensor along ``placement.dim``: ``Shard``, or the
    strided shard FSDP2 places over tensor parallelism's. Private:
    ``torch.distributed.tensor.placement_types._StridedShard``."""
    from torch.distributed.tensor import Shard as TensorShard
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, (TensorShard, _StridedShard))


def _probe_dtensor_piece() -> object:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset


def _probe_module_parameters() -> dict:
    parameters = module_parameters(torch.nn.Linear(1, 1))
    assert set(parameters) == {"weight", "bias"}, f"nn.Module._parameters holds {set(parameters)}"
    return parameters


# -- Muon (torch.optim._muon) --


def muon_orthogonalized(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                        eps: float) -> torch.Tensor:
    """Muon's Newton-Schulz orthogonalization of ``grad``, torch's own math (for the whole matrix
    of a split table). Private API: ``torch.optim._muon._zeropower_via_newtonschulz``."""
    return _muon._zeropower_via_newtonschulz(grad, coefficients, steps, eps)


def muon_adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's learning rate for a matrix of ``shape``, torch's own rule. Private API:
    ``torch.optim._muon._adjust_lr``."""
    return _muon._adjust_lr(lr, adjust_lr_fn, shape)


# -- TorchRec's compiling train pipelines --

_COMPILING_PIPELINES = ("TrainPipelinePT2", "TrainPipelineSparseDistCompAutograd")


def compiling_pipeline() -> str | None:
    """The name of TorchRec's train pipeline that compiles the model (``TrainPipelinePT2``: Dynamo;
    ``TrainPipelineSparseDistCompAutograd``: compiled autograd) whose ``progress`` runs on this
    thread, or None. Private: those classes' ``progress`` frames."""
    import inspect

    from torchrec.distributed.train_pipeline import train_pipelines

    codes = {inspect.unwrap(getattr(train_pipelines, n).progress).__code__: n for n in _COMPILING_PIPELINES}
    frame = sys._getframe(1)
    while frame is not None and frame.f_code not in codes:
        frame = frame.f_back
    return None if frame is None else codes[frame.f_code]


def _probe_compiling_pipeline() -> object:
    import inspect

    from torchrec.distributed.train_pipeline import train_pipelines

    for name in _COMPILING_PIPELINES:
        if "_optimizer" not in inspect.unwrap(getattr(train_pipelines, name).progress).__code__.co_names:
            raise AttributeError(f"{name}.progress no longer calls its optimizer")
    return compiling_pipeline


# -- TorchRec's gradient accumulation wrapper (train_pipeline.GradientAccumulationWrapper) --


def torchrec_holds_step(optimizer: Any) -> bool | None:
    """While TorchRec's ``GradientAccumulationWrapper.progress`` runs on this thread around a
    pipeline whose optimizer is ``optimizer`` (or a ``CombinedOptimizer`` holding it): whether the
    wrapper will not step after this micro-batch (True), or will (False: the window's last, or
    ``is_last_batch``). None when no such wrapper runs. Private: the frame of
    ``GradientAccumulationWrapper.progress`` (its ``self`` and ``is_last_batch``), and the wrapper's
    ``_config.is_enabled``, ``_optimizer_wrapper._optimizer`` and ``._should_step()``."""
    from torchrec.distributed.train_pipeline.gradient_accumulation import GradientAccumulationWrapper

    code = GradientAccumulationWrapper.progress.__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    if frame is None:
        return None
    wrapper = frame.f_locals["self"]
    stepped = wrapper._optimizer_wrapper._optimizer
    if not wrapper._config.is_enabled or (stepped is not optimizer and all(
            o is not optimizer for _, o in getattr(stepped, "optimizers", []))):
        return None
    return not (frame.f_locals.get("is_last_batch") or wrapper._optimizer_wrapper._should_step())


def _probe_torchrec_holds_step() -> object:
    from torchrec.distributed.train_pipeline.gradient_accumulation import (
        GradientAccumulationConfig, GradientAccumulationWrapper,
    )

    pipeline = type("Pipeline", (), {"_optimizer": None})()
    wrapper = GradientAccumulationWrapper(pipeline, "opt", torch.nn.Linear(1, 1), GradientAccumulationConfig(num_steps=2))
    assert wrapper._config.is_enabled and wrapper._optimizer_wrapper._optimizer == "opt"
    assert wrapper._optimizer_wrapper._should_step() is False
    names = GradientAccumulationWrapper.progress.__code__.co_varnames
    if "self" not in names or "is_last_batch" not in names:
        raise AttributeError("GradientAccumulationWrapper.progress no longer takes self and is_last_batch")
    return torchrec_holds_step


# -- torch.distributed.checkpoint.state_dict (get_state_dict / set_state_dict) --

_TORCH_STATE_DICT_API = "torch.distributed.checkpoint.state_dict"


def called_from_torch_state_dict_api() -> bool:
    """Whether the function that calls this one was called by torch's ``get_state_dict`` /
    ``set_state_dict`` machinery (``get_optimizer_state_dict``, ...), which calls an optimizer's
    ``step``, ``state_dict`` and ``load_state_dict`` from its own module. Private: those callers
    (``_init_optim_state``, ``_get_optim_state_dict``, ``_load_optim_state_dict``) are private."""
    frame = sys._getframe(2)
    for _ in range(3):  # the caller's caller, through a decorator or two
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == _TORCH_STATE_DICT_API:
            return True
        frame = frame.f_back
    return False


def _probe_torch_state_dict_api() -> object:
    import torch.distributed.checkpoint.state_dict as api

    for name in ("_init_optim_state", "_get_optim_state_dict", "_load_optim_state_dict"):
        if api.__name__ != _TORCH_STATE_DICT_API or not callable(getattr(api, name, None)):
            raise AttributeError(f"{_TORCH_STATE_DICT_API}.{name} is gone: the optimizer's caller is no longer found")
    return api


# -- TorchRec's KeyedOptimizer (the one TorchRec contract of the core) --


def saves_param_groups(optimizer: Any) -> bool:
    """Whether a TorchRec ``KeyedOptimizer`` puts its param groups in its state dict. Private:
    ``KeyedOptimizer.defaults["_save_param_groups"]`` (set by ``save_param_groups``; a
    ``CombinedOptimizer`` wants every optimizer it holds to agree)."""
    return optimizer.defaults["_save_param_groups"]


def _probe_save_param_groups() -> bool:
    from torchrec.optim.keyed import KeyedOptimizer

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = KeyedOptimizer({"p": param}, {}, [{"params": [param]}])
    optimizer.save_param_groups(True)
    assert optimizer.defaults["_save_param_groups"] is True, "save_param_groups no longer sets the flag"
    return saves_param_groups(optimizer)


# The name under which TorchRec's ``DistributedModelParallel`` registers the module it wraps
# (a plain string: the core does not import TorchRec's model parallel). Private API.
DMP_WRAPPED = "_dmp_wrapped_module"


def _probe_dmp_wrapped() -> str:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    if DMP_WRAPPED not in DistributedModelParallel.__init__.__code__.co_names:
        raise AttributeError(f"DistributedModelParallel no longer registers {DMP_WRAPPED}")
    return DMP_WRAPPED


PRIVATE_APIS: dict[str, Callable[[], object]] = {
    "torch.autograd.Variable._execution_engine.queue_callback": lambda: Variable._execution_engine.queue_callback,
    "torch._C._current_graph_task_id": lambda: torch._C._current_graph_task_id,
    "torch.nn.parallel.DistributedDataParallel._module_parameters": lambda: _probe_ddp()._module_parameters,
    "torch.nn.parallel.DistributedDataParallel._lazy_init_ran": lambda: _probe_ddp()._lazy_init_ran,
    "torch.nn.parallel.DistributedDataParallel._static_graph_delay_allreduce_enqueued": (
        lambda: DistributedDataParallel(torch.nn.Linear(1, 1), static_graph=True)._static_graph_delay_allreduce_enqueued
    ),
    "torch.distributed.Reducer._set_optimizer_in_backward": lambda: dist.Reducer._set_optimizer_in_backward,
    "torch.distributed.optim.apply_optimizer_in_backward.param_to_optim_hook_handle_map": (
        lambda: _torch_in_backward.param_to_optim_hook_handle_map
    ),
    "torch.distributed.optim._apply_optimizer_in_backward sets _optimizer_classes, _optimizer_kwargs, "
    "_in_backward_optimizers": _annotation_contract,
    "torch.utils.hooks.RemovableHandle.hooks_dict_ref, .id": _probe_handle,
    "torch.distributed._shard.sharded_tensor.ShardedTensor._init_from_local_shards_and_global_metadata": (
        lambda: ShardedTensor._init_from_local_shards_and_global_metadata
    ),
    "torch.distributed._shard.sharded_tensor.ShardedTensor._process_group": (
        lambda: _probe_sharded_tensor()._process_group
    ),
    "torch.distributed.fsdp FSDPState._fsdp_param_groups, FSDPParam._orig_param_uid, .sharded_param, _get_orig_param_uid": (
        _fsdp_contract
    ),
    "torch.utils._pytree.tree_leaves": lambda: _pytree.tree_leaves,
    "torch.Tensor._version": _probe_version,
    "torch.nn.Module._parameters": _probe_module_parameters,
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset": _probe_dtensor_piece,
    "torch.distributed.tensor.placement_types._StridedShard": lambda: splits(_probe_strided_shard()),
    "torch.optim._muon._zeropower_via_newtonschulz": lambda: _muon._zeropower_via_newtonschulz,
    "torch.optim._muon._adjust_lr": lambda: _muon._adjust_lr,
    "torchrec.optim.keyed.KeyedOptimizer.defaults['_save_param_groups']": _probe_save_param_groups,
    "torchrec.distributed.model_parallel.DistributedModelParallel._dmp_wrapped_module": _probe_dmp_wrapped,
    "torchrec TrainPipelinePT2.progress, TrainPipelineSparseDistCompAutograd.progress": _probe_compiling_pipeline,
    "torchrec GradientAccumulationWrapper.progress(self, is_last_batch), ._config.is_enabled, "
    "._optimizer_wrapper._optimizer, ._should_step()": _probe_torchrec_holds_step,
    "torch.distributed.checkpoint.state_dict._init_optim_state, _get_optim_state_dict, _load_optim_state_dict": (
        _probe_torch_state_dict_api
    ),
    **{f"torch._foreach_{op}": _foreach_entry(op) for op in _FOREACH_OPS},
    **{f"torch._fused_{op}": (lambda name=f"_fused_{op}": getattr(torch, name)) for op in _FUSED_OPS},
}
