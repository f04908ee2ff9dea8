"""Rank bodies for tests/test_pipelines.py (spawned; not collected by pytest), and the test-only
stand-in for CPU streams.

TorchRec's stream pipelines (SemiSync, FusedSparseDist, Prefetch, Staged) call ``record_stream`` on
the batch's tensors, which a CPU tensor refuses ("unknown parameter type"), and take CUDA's streams
where they were given none, for stock TorchRec too. :func:`cpu_streams` makes them CPU streams while
it is entered: on CPU every kernel runs in order, so waiting on or recording a stream changes nothing. It lives here, for tests only; the library patches
nothing of TorchRec's or torch's.

The model is ``tests/_ec_bodies._SharedModel``: an EC whose table ``shared`` two features look up
(fallback Adam) and ``own`` (fused Adagrad), and an SGD head; row_wise on 2 ranks.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

import overlap_optim
import sharders
from _ec_bodies import _global_batch, _shared_batches, _SharedModel
from _models import position_weighted
from _sharded_parity import local_pieces, shard_like_reference

NAMES = ("shared", "own")
SETTINGS = {"shared": (torch.optim.Adam, {"lr": 0.05}), "own": (torch.optim.Adagrad, {"lr": 0.1})}
HEAD = (torch.optim.SGD, {"lr": 0.1})


@contextlib.contextmanager
def cpu_streams() -> Iterator[None]:
    """While inside, ``Tensor.record_stream`` is a no-op for CPU tensors, and the device module of
    "cuda" (which TorchRec's pipelined forwards take when they were given no stream) is ``torch.cpu``,
    whose streams do nothing (see the module doc)."""
    record, device_module = torch.Tensor.record_stream, torch.get_device_module

    def record_stream(tensor: torch.Tensor, stream: object) -> None:
        if tensor.device.type != "cpu":
            record(tensor, stream)

    def get_device_module(device: object = None) -> object:
        if not torch.cuda.is_available() and torch.device(device or "cuda").type == "cuda":
            return torch.cpu
        return device_module(device)

    torch.Tensor.record_stream, torch.get_device_module = record_stream, get_device_module
    try:
        yield
    finally:
        torch.Tensor.record_stream, torch.get_device_module = record, device_module


def with_cpu_streams(pipeline):
    """``pipeline`` with CPU streams where TorchRec makes streams only on CUDA and MTIA and leaves None on
    CPU: the prefetch pipeline prefetches only on a data-dist stream, and its pipelined forward asserts
    that a prefetch ran (stock fails so on CPU). Test-only, as :func:`cpu_streams`."""
    for name in ("_data_dist_stream", "_prefetch_stream", "_default_stream"):
        if hasattr(pipeline, name) and getattr(pipeline, name) is None:
            setattr(pipeline, name, _CpuStream())
    return pipeline


class _CpuStream(torch.cpu.Stream):
    """torch's CPU stream (it does nothing: CPU kernels run in order), with the ``device`` that
    TorchRec's stream contexts read."""

    device = torch.device("cpu")


def _built(rank: int, world_size: int, clip: float | None = None, tables_only: bool = False):
    """Ours sharded (row_wise) and its unsharded copy; ``clip``: a clipping set over every parameter
    (over the tables alone with ``tables_only``) with that bound."""
    model = _SharedModel()
    reference = copy.deepcopy(model)
    for name in NAMES:
        cls, kwargs = SETTINGS[name]
        overlap_optim.apply_optimizer_in_backward(cls, [model.ec.embeddings[name].weight], kwargs)
    overlap_optim.apply_optimizer_in_backward(HEAD[0], model.head.parameters(), HEAD[1])
    if clip is not None:
        members = [model.ec.embeddings[n].weight for n in NAMES] if tables_only else model.parameters()
        overlap_optim.apply_gradient_clipping(members, max_norm=clip)
    dmp = shard_like_reference(model, reference, list(NAMES), dict.fromkeys(NAMES, "row_wise"), world_size,
                               sharders.EmbeddingCollectionSharder())
    return dmp, overlap_optim.get_optimizers(dmp), reference


class _SemiSyncReference:
    """One process, on the global batch, in SemiSync's documented order: batch j is looked up with the
    tables as they were before batch j-1's update (after the updates of batches 0..j-2); its gradient
    then updates the tables as they are (after batch j-1's). The head is synchronous. With ``clip``,
    the gradients of the tables and the head (the tables alone with ``tables_only``) are clipped to
    that global norm before the step."""

    def __init__(self, model: _SharedModel, clip: float | None = None, tables_only: bool = False) -> None:
        self.model, self.clip = model, clip
        self.clipped = [model.ec.embeddings[n].weight for n in NAMES] if tables_only else list(model.parameters())
        self.opts = [cls([model.ec.embeddings[n].weight], **kw) for n, (cls, kw) in SETTINGS.items()]
        self.opts.append(HEAD[0](model.head.parameters(), **HEAD[1]))
        self.looked_up = copy.deepcopy(model.ec)  # the tables batch j looks up
        self.start = {n: model.ec.embeddings[n].weight.detach().clone() for n in NAMES}

    def step(self, j: int, batch, apply: bool = True) -> None:
        """Batch ``j``; with ``apply`` False its gradients are held (added to the next batch's)."""
        tables = self.model.ec.embeddings
        before = {n: tables[n].weight.detach().clone() for n in NAMES}  # before batch j's update
        sequences = self.looked_up(batch.sparse_features)
        prediction = self.model.head(torch.cat([position_weighted(sequences[k]) for k in ("a", "b", "c")], dim=1))
        (prediction.squeeze(1) - batch.labels).pow(2).mean().backward()
        if apply:
            for name in NAMES:
                tables[name].weight.grad = self.looked_up.embeddings[name].weight.grad
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.clipped, self.clip)
            for opt in self.opts:
                opt.step()
                opt.zero_grad()
            self.looked_up.zero_grad()
        if j >= 1:  # batch j+1 is looked up before batch j's update: with the tables as they were before it
            with torch.no_grad():
                for name in NAMES:
                    self.looked_up.embeddings[name].weight.copy_(before[name])

    def moved(self) -> float:
        return min((self.model.ec.embeddings[n].weight.detach() - self.start[n]).abs().max().item() for n in NAMES)


def _local_state(dmp) -> dict[str, list[torch.Tensor]]:
    """A copy of this rank's pieces of every weight."""
    return {k: [s.tensor.clone() for s in v.local_shards()] if hasattr(v, "local_shards") else [v.clone()]
            for k, v in dmp.state_dict().items()}


def _diff(dmp, reference: _SharedModel) -> float:
    tables = max((piece - reference.ec.embeddings[n].weight.detach()[r : r + piece.shape[0], c : c + piece.shape[1]])
                 .abs().max().item() for n in NAMES for r, c, piece in local_pieces(dmp, n) if piece.numel())
    state = dmp.state_dict()
    return max(tables, *((state[f"head.{n}"] - p).abs().max().item() for n, p in reference.head.named_parameters()))


def semi_sync(rank: int, world_size: int, steps: int = 3, micro: int = 2, clip: float = 0.05, reload_at: int = 1) -> dict:
    """``TrainPipelineSemiSync(start_batch=0)`` against :class:`_SemiSyncReference`, with ``micro``
    micro-batches a step (all but the last in ``no_step``), a clipping set over the tables (one module:
    one backward pass of SemiSync) with a bound that binds, and the keyed optimizer's state dict saved
    and loaded back after step ``reload_at``; compared after every micro-batch. Also how far the same
    steps in synchronous order end from it."""
    import io

    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync

    dmp, keyed, model = _built(rank, world_size, clip=clip, tables_only=True)
    synchronous = copy.deepcopy(model)  # what SemiSync's order changes: the same steps, each batch looked up after
    sync_opts = [cls([synchronous.ec.embeddings[n].weight], **kw) for n, (cls, kw) in SETTINGS.items()]
    sync_opts.append(HEAD[0](synchronous.head.parameters(), **HEAD[1]))
    reference = _SemiSyncReference(model, clip=clip, tables_only=True)
    unclipped = _SemiSyncReference(copy.deepcopy(model))  # the bound binds: it ends elsewhere
    batches = [_shared_batches(j, world_size) for j in range(steps * micro)]
    diffs = []
    with cpu_streams():
        pipeline = TrainPipelineSemiSync(dmp, keyed, torch.device("cpu"), start_batch=0)
        local = iter([parts[rank] for parts in batches])
        for j in range(steps * micro):
            last = j % micro == micro - 1
            with contextlib.nullcontext() if last else overlap_optim.no_step(dmp):
                pipeline.progress(local)
            reference.step(j, _global_batch(batches[j]), apply=last)
            unclipped.step(j, _global_batch(batches[j]), apply=last)
            diffs.append(_diff(dmp, model))
            synchronous(_global_batch(batches[j]))[0].backward()
            if last:
                torch.nn.utils.clip_grad_norm_([synchronous.ec.embeddings[n].weight for n in NAMES], clip)
                for opt in sync_opts:
                    opt.step()
                    opt.zero_grad()
            if last and j // micro == reload_at:
                buffer = io.BytesIO()
                torch.save(keyed.state_dict(), buffer)
                buffer.seek(0)
                keyed.load_state_dict(torch.load(buffer, weights_only=False))
    gap = max((synchronous.ec.embeddings[n].weight - model.ec.embeddings[n].weight).abs().max().item() for n in NAMES)
    unclipped_gap = max((unclipped.model.ec.embeddings[n].weight - model.ec.embeddings[n].weight).abs().max().item()
                        for n in NAMES)
    return {"diffs": diffs, "moved": reference.moved(), "gap_to_synchronous": gap, "gap_to_unclipped": unclipped_gap}


def staged_lookup_ahead(rank: int, world_size: int, steps: int = 4, clip: float = 0.05) -> dict:
    """``StagedTrainPipeline`` with an embedding-lookup stage, clipped by a global norm that binds,
    against :class:`_SemiSyncReference` (its order is SemiSync's; one backward pass a step, so one
    clipping round over the tables and the head), compared after every step."""
    dmp, keyed, model = _built(rank, world_size, clip=clip)
    reference = _SemiSyncReference(model, clip=clip)
    unclipped = _SemiSyncReference(copy.deepcopy(model))  # the bound binds: it ends elsewhere
    batches = [_shared_batches(j, world_size) for j in range(steps)]
    diffs = []
    with cpu_streams():
        progress = _staged(dmp, keyed, lookup_ahead=True)
        local = iter([parts[rank] for parts in batches])
        for j in range(steps):
            progress(local)
            reference.step(j, _global_batch(batches[j]))
            unclipped.step(j, _global_batch(batches[j]))
            diffs.append(_diff(dmp, model))
    gap = max((unclipped.model.ec.embeddings[n].weight - model.ec.embeddings[n].weight).abs().max().item()
              for n in NAMES)
    return {"diffs": diffs, "moved": reference.moved(), "gap_to_unclipped": gap}


def semi_sync_refused(rank: int, world_size: int, clip: bool = False, stash: bool = False) -> dict:
    """SemiSync with a clipping set over the tables and the head (``clip``), or with
    ``stash_gradients=True`` (``stash``): the error of the first ``progress``, and whether every table
    piece and the head are as they were."""
    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync

    dmp, keyed, _ = _built(rank, world_size, clip=0.01 if clip else None)
    before = _local_state(dmp)
    with cpu_streams():
        pipeline = TrainPipelineSemiSync(dmp, keyed, torch.device("cpu"), start_batch=0, stash_gradients=stash)
        try:
            pipeline.progress(iter([_shared_batches(j, world_size)[rank] for j in range(3)]))
            error = "no error"
        except NotImplementedError as err:
            error = str(err)
    after = _local_state(dmp)
    return {"error": error, "unchanged": all(torch.equal(a, b) for k in before for a, b in zip(before[k], after[k]))}


def compiling(rank: int, world_size: int, which: str) -> dict:
    """TorchRec's ``TrainPipelinePT2`` (its default: compile at the 4th step, inductor) or
    ``TrainPipelineSparseDistCompAutograd`` (with torch's python reducer for DDP, which compiled autograd
    needs): the error of the first ``progress``, and whether every weight is as it was."""
    import torch._dynamo
    from torchrec.distributed.train_pipeline import train_pipelines

    dmp, keyed, _ = _built(rank, world_size, clip=0.5)
    before = _local_state(dmp)
    local = iter([_shared_batches(j, world_size)[rank] for j in range(5)])
    with contextlib.ExitStack() as stack:
        if which == "pt2":
            pipeline = train_pipelines.TrainPipelinePT2(dmp, keyed, torch.device("cpu"))
        else:
            stack.enter_context(torch._dynamo.config.patch(optimize_ddp="python_reducer"))
            pipeline = train_pipelines.TrainPipelineSparseDistCompAutograd(dmp, keyed, torch.device("cpu"))
        try:
            pipeline.progress(local)
            error = "no error"
        except NotImplementedError as err:
            error = str(err)
    after = _local_state(dmp)
    return {"error": error, "unchanged": all(torch.equal(a, b) for k in before for a, b in zip(before[k], after[k]))}


def _staged(dmp, keyed, lookup_ahead: bool = False):
    """TorchRec's ``StagedTrainPipeline`` with its sparse-data-dist stage (and, ``lookup_ahead``, its
    embedding-lookup stage, which makes it semi-synchronous), and the loop its docs give (the pipeline
    hands over each batch, the loop runs the model, backward and the step): a callable that runs
    one micro-batch."""
    from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage, SparseDataDistUtil
    from torchrec.distributed.train_pipeline.train_pipelines import StagedTrainPipeline

    sdd = SparseDataDistUtil(dmp, data_dist_stream=_CpuStream(), 
                             embedding_lookup_stream=_CpuStream() if lookup_ahead else None)
    stages = [PipelineStage("start_sparse_data_dist", sdd.start_sparse_data_dist, sdd.data_dist_stream,
                            fill_callback=sdd.wait_sdd_fill_callback)]
    if lookup_ahead:
        stages.append(PipelineStage("start_embedding_lookup", sdd.start_embedding_lookup, sdd.embedding_lookup_stream))
    pipeline = StagedTrainPipeline(compute_stream=_CpuStream(), pipeline_stages=stages)

    def progress(batches) -> None:
        keyed.zero_grad()
        loss, _ = dmp(pipeline.progress(batches))
        loss.backward()
        keyed.step()
    return progress


def synchronous(rank: int, world_size: int, pipeline: str, steps: int = 4, micro: int = 2, reload_at: int = 1) -> dict:
    """One of TorchRec's synchronous train pipelines (``pipeline``, a class of its ``train_pipelines``,
    or "StagedTrainPipeline": :func:`_staged`) against one process of ``torch.optim`` on the global
    batch, with clipping by a norm that binds, ``micro`` micro-batches a step (all but the last in
    ``overlap_optim.no_step``), and the keyed optimizer's state dict saved and loaded back
    (``torch.save``) after step ``reload_at``; compared after every step."""
    import io

    from torchrec.distributed.train_pipeline import train_pipelines

    batches = [_shared_batches(j, world_size) for j in range(steps * micro)]
    probe = _SharedModel()
    probe(_global_batch(batches[0]))[0].backward()
    bound = 0.3 * torch.nn.utils.get_total_norm([p.grad for p in probe.parameters()]).item()
    dmp, keyed, model = _built(rank, world_size, clip=bound)
    opts = [cls([model.ec.embeddings[n].weight], **kw) for n, (cls, kw) in SETTINGS.items()]
    opts.append(HEAD[0](model.head.parameters(), **HEAD[1]))
    start = {n: model.ec.embeddings[n].weight.detach().clone() for n in NAMES}
    diffs = []
    with cpu_streams():
        if pipeline == "StagedTrainPipeline":
            progress = _staged(dmp, keyed)
        else:
            progress = with_cpu_streams(getattr(train_pipelines, pipeline)(dmp, keyed, torch.device("cpu"))).progress
        local = iter([parts[rank] for parts in batches])
        for j in range(steps):
            for m in range(micro):
                with overlap_optim.no_step(dmp) if m < micro - 1 else contextlib.nullcontext():
                    progress(local)
                model(_global_batch(batches[j * micro + m]))[0].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), bound)
            for opt in opts:
                opt.step()
                opt.zero_grad()
            diffs.append(_diff(dmp, model))
            if j == reload_at:
                buffer = io.BytesIO()
                torch.save(keyed.state_dict(), buffer)
                buffer.seek(0)
                keyed.load_state_dict(torch.load(buffer, weights_only=False))
    moved = min((model.ec.embeddings[n].weight.detach() - start[n]).abs().max().item() for n in NAMES)
    return {"diffs": diffs, "moved": moved}
