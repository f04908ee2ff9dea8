"""What is refused, and why: the one list of combinations that cannot be made exact.

Every other combination of annotations, sharding, collections, batches and training loop trains
exactly as ``torch.optim`` on the unsharded model. Each entry here is refused at the stage it names,
on every rank, before anything changes, with a message that names the table or setting and matches
:attr:`Refusal.match`.

This list is the source of ``docs/refusals.md`` (``python -m sharders.refusals``) and of what the
promise matrix (``tests/test_promise_matrix.py``) accepts as a refusal: an outcome that is neither
exact nor one of these is a failure.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["Refusal", "REFUSALS", "refusal", "markdown"]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One refused combination.

    Attributes:
        name: its key.
        combination: what the user asked for, in their words.
        stage: when it is refused: "annotate", "shard" or "first step".
        why: why it cannot be exact (or is not built).
        instead: what works.
        match: a regular expression the refusal's message matches.
        sampled: whether the promise matrix draws it by a predicate on the configuration.
        data_dependent: it depends on the values trained, not on the configuration: it is raised on
            every rank at the step after the one it concerns, and the matrix accepts it there.
    """

    name: str
    combination: str
    stage: str
    why: str
    instead: str
    match: str
    sampled: bool = True
    data_dependent: bool = False

    def matches(self, message: str) -> bool:
        return re.search(self.match, message) is not None


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "fused_params_update_keys",
        "fused_params keys that change FBGEMM's update or lookup: gradient_clipping / max_gradient, "
        "weight_decay_mode (COWCLIP, counter-based), momentum, beta1, beta2, eta, output_dtype, cache_precision",
        "sharder",
        "FBGEMM's gradient clipping clamps the pooled output gradient, not the rows' gradients; the others "
        "change the update or its precision, where every table steps exactly as torch.optim",
        "clip with overlap_optim.apply_gradient_clipping; set optimizer settings in the annotation",
        r"fused_params \[.*\]: FBGEMM would change the update",
    ),
    Refusal(
        "unrunnable_compute_kernel",
        "a plan whose compute kernel for a table is not one we run: key_value, ssd, quant..., and fused_uvm or "
        "fused_uvm_caching on CPU",
        "shard",
        "the table would silently run in another kernel than the plan says",
        "compute kernel \"fused\" (or \"dense\" to pin the table to the fallback)",
        r"the plan gives it compute kernel .* which overlap-optim does not run",
    ),
    Refusal(
        "low_precision_table",
        "an FP16 or BF16 table (EmbeddingBagConfig(data_type=DataType.FP16)) that no in-backward optimizer "
        "of ours steps and that is not frozen: stepped by the user's optimizer",
        "shard",
        "the exact reference (torch.optim in float32 on the stored weights, rounded once) is built for the "
        "fallback (touched rows, the whole shard, a cross-shard table's shards, or a data-parallel table's whole "
        "table on its gradient averaged across ranks); the user's optimizer would get and step a gradient in the "
        "stored dtype",
        "an in-backward optimizer on a model-parallel sharding type or data_parallel (fused where our compiled "
        "backward steps FP16: FBGEMM's own CPU backward rounds twice and it has no BF16 kernels), or a float32 "
        "table",
        r"holds its weights in (FP16|BF16) and runs as",
    ),
    Refusal(
        "low_precision_state",
        "state_dtype=torch.bfloat16 (or float16) on a table of a kind that keeps its state in float32 only: a "
        "kind added outside the package whose low_precision_state is False (every built-in kind that steps a "
        "table keeps state_dtype: the fallback on touched rows, on whole shards and across shards, the DDP hook)",
        "shard",
        "that kind keeps its own float32 state, with no low-precision form",
        "a built-in kind, or no state_dtype",
        r"state_dtype=torch\.(bfloat16|float16).*keeps its optimizer state in float32 only",
        sampled=False,  # the promise matrix draws the built-in kinds only
    ),
    Refusal(
        "not_separable",
        "a table split into column (row) shards whose optimizer's update is not separable by columns "
        "(rows) and has no cross-shard form: pytorch-optimizer's AdamP, and torchrec's RowWiseAdagrad with "
        "weight_decay on column_wise or table_column_wise",
        "shard",
        "its update reads statistics of the whole matrix (AdamP), or weight decay makes lazy and dense "
        "semantics differ where the cross-shard form of RowWiseAdagrad is built for the rows a batch touched",
        "table_wise or data_parallel for that table (for RowWiseAdagrad, row_wise or table_row_wise too, or no "
        "weight_decay)",
        r"is not separable by (rows|columns)",
    ),
    Refusal(
        "clipped_user_table",
        "a sharded table with no in-backward optimizer in a gradient clipping set",
        "shard",
        "its gradient goes to your own optimizer after backward, outside the clipping round",
        "annotate the table, or leave it out of the set",
        r"has no in-backward optimizer and is in a gradient clipping set",
    ),
    Refusal(
        "clipped_unreduced_dense",
        "on several ranks, a dense parameter without an annotation in a gradient clipping set, under a DDP "
        "that is not overlap_optim's (TorchRec's default data_parallel_wrapper, plain DDP)",
        "first step",
        "the clipping round cannot tell whether that DDP has reduced the gradient when it measures the norm",
        "DistributedModelParallel(..., data_parallel_wrapper=sharders.DataParallelWrapper())",
        r"with no annotation is in the clipping set, and no DDP hook of overlap_optim reduces it",
    ),
    Refusal(
        "variable_batch",
        "a batch with a variable batch size per feature (VBE) for an EBC with a data-parallel, frozen or "
        "unannotated table, or a MEAN-pooled row_wise or table_row_wise one, or inside no_step; without "
        "variable_batch=True also a fused Adagrad or clipped fused table",
        "first step, or shard with variable_batch=True",
        "FBGEMM's dense TBE on CPU ignores the batch sizes per feature (TorchRec's data-parallel and unannotated "
        "lookups), TorchRec's mean divisor of row-split tables reads one batch size, FBGEMM's variable-batch "
        "backward exists for SGD and row-wise Adagrad only and cannot be held for a norm, and a no_step window "
        "concatenates micro-batches of one batch size",
        "EmbeddingBagCollectionSharder(variable_batch=True) with every table annotated on a model-parallel "
        "sharding type: fused SGD and RowWiseAdagrad where they can, the fallback for the rest",
        r"variable batch size per feature \(VBE\) reached tables that cannot take it|variable_batch=True(, and "
        r"the module .* has tables that no kernel runs exactly|: it runs as)",
    ),
    Refusal(
        "meta_dense_foreign_wrapper",
        "a model built on the meta device whose dense part is annotated or clipped, under TorchRec's default "
        "data_parallel_wrapper (or another that is not overlap_optim's)",
        "shard",
        "TorchRec's init_parameters replaces each meta parameter with a new one, and that wrapper does not carry "
        "the annotation over: the dense part would train nothing, or go unclipped",
        "DistributedModelParallel(..., data_parallel_wrapper=sharders.DataParallelWrapper()), or "
        "overlap_optim.materialize(model, device) before DMP",
        r"is annotated \(or clipped\) on the meta device, and the data_parallel_wrapper",
    ),
    Refusal(
        "adafactor_variance_floor",
        "torch.optim.Adafactor on a table split into row or column shards (or under FSDP2) whose variance floor "
        "eps1**2 binds on an element with a nonzero gradient (gradients near 1e-7: MEAN pooling over long bags, "
        "or a large eps[0])",
        "the next step",
        "the one all-reduce per step carries the update's RMS through an identity that the floor breaks; "
        "checking it would take a second all-reduce per step. The step where it binds is already taken",
        "table_wise or data_parallel for that table, or a smaller eps[0]",
        r"Adafactor's variance floor eps1\*\*2 bound an element with a nonzero gradient",
        sampled=False,
        data_dependent=True,
    ),
    Refusal(
        "ambiguous_table_option",
        "a bare table name in fallback_tables or dense_tables that tables of two collections of the model share",
        "shard",
        "it could mean either table",
        "qualify it with the collection's path: dense_tables=[\"ebc_a.t0\"]",
        r"a table of each of the modules",
    ),
    Refusal(
        "semi_sync_clipping",
        "TorchRec's TrainPipelineSemiSync with a gradient clipping set over a module's tables and the dense part "
        "(or the tables of two modules)",
        "first step",
        "SemiSync runs the dense backward and each module's embedding backward as separate backward passes; a "
        "set's norm closes at the end of each, so each part would be clipped by a norm of its own",
        "separate clipping sets per module and for the dense part, or TrainPipelineSparseDist",
        r"TrainPipelineSemiSync with a clipping set over the tables",
        sampled=False,
    ),
    Refusal(
        "semi_sync_stash",
        "TorchRec's TrainPipelineSemiSync(stash_gradients=True) with annotated dense parameters",
        "first step",
        "stash steps the dense optimizer on the previous batch's gradients; in-backward optimizers step on this "
        "batch's during backward",
        "stash_gradients=False, or your own optimizer for the dense part",
        r"TrainPipelineSemiSync\(stash_gradients=True\) with in-backward optimizers",
        sampled=False,
    ),
    Refusal(
        "compiling_pipeline",
        "TorchRec's TrainPipelinePT2 and TrainPipelineSparseDistCompAutograd",
        "first step",
        "they compile the model (Dynamo, compiled autograd), which cannot trace the in-backward updates",
        "TrainPipelineSparseDist or TrainPipelineBase",
        r"compiles the model \(torch.compile or compiled autograd\)",
        sampled=False,
    ),
    Refusal(
        "accumulation_flush",
        "TorchRec's GradientAccumulationWrapper when the data ends inside a window (its flush)",
        "the flush",
        "nothing steps a window's held micro-batches but the backward of its last one",
        "a number of micro-batches that is a multiple of num_steps, or is_last_batch=True on the last",
        r"GradientAccumulationWrapper stepped the optimizer",
        sampled=False,
    ),
    Refusal(
        "managed_collision",
        "a managed-collision collection (ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection) "
        "sharded by any sharder but ours (TorchRec's managed-collision sharder, or our collection sharder on its inner "
        "collection), in a model our planner plans, our sharders shard or our data-parallel wrappers wrap",
        "plan, or shard (before any module is sharded; under our wrappers alone, after DMP has sharded it)",
        "another sharder leaves an evicted slot's optimizer state to its new id (TorchRec's), or remaps each rank's "
        "batch on that rank apart (ours on the inner collection)",
        "sharders.ManagedCollisionEmbeddingBagCollectionSharder (or ManagedCollisionEmbeddingCollectionSharder), "
        "passed to the planner and DistributedModelParallel",
        r"shard managed-collision collections with sharders.ManagedCollision",
        sampled=False,
    ),
    Refusal(
        "managed_collision_state",
        "a table of a managed-collision collection with no in-backward optimizer, or one whose optimizer keeps "
        "state that is not per row (Adafactor's or CAME's column factors)",
        "plan, or shard (before any module is sharded)",
        "an eviction gives the evicted slot a fresh row's state: your own optimizer's state is out of reach, and a "
        "column factor is shared by every row",
        "annotate the table with an optimizer whose state is per row or per element (Adagrad, Adam, SGD...)",
        r"(has no in-backward optimizer: your own optimizer keeps its state|keeps state that is not per row)",
    ),
    Refusal(
        "managed_collision_weighted",
        "a managed-collision collection over a weighted EmbeddingBagCollection (is_weighted=True)",
        "plan, or shard (before any module is sharded)",
        "TorchRec's sharded managed-collision collection looks its ids up as if every per-sample weight were 1 "
        "(0.03-0.2 off a reference that weighs them)",
        "weigh the pooled embeddings in the model, or use an unweighted collection",
        r"holds a weighted .* \(is_weighted=True\): TorchRec's sharded managed-collision collection drops",
    ),
    Refusal(
        "managed_collision_reshard",
        "a checkpoint of managed-collision tables loaded into other row shards (another world size or plan)",
        "load (overlap_optim.checkpoint.load: before anything changes; load_state_dict, dcp.load: before it "
        "loads, after dcp.load wrote the tensors in place; and every forward after)",
        "each row shard's managed-collision module remaps ids into its own slots; TorchRec merges the saved "
        "slots, and the merged remapping does not go on as it did (2 ranks resumed on 1: 3.2-4.1 off)",
        "load it on the world size and plan it was saved with",
        r"managed-collision table '.*': the state dict was saved with its rows in the shards",
        sampled=False,
    ),
    Refusal(
        "two_dimensional",
        "2D sparse parallelism: TorchRec's DMPCollection (a ShardingEnv2D) with our sharders or data-parallel wrappers",
        "shard",
        "DMPCollection.sync() averages only FBGEMM's fused kernels and their 'sum' state, so the other kinds' state "
        "would drift between replicas, and the end-of-backward rounds would reduce across replicas",
        "DistributedModelParallel over every rank",
        r"2D sparse parallelism \(DMPCollection",
        sampled=False,
    ),
)


def refusal(name: str) -> Refusal:
    """The entry named ``name``; KeyError listing the names for an unknown one."""
    for entry in REFUSALS:
        if entry.name == name:
            return entry
    raise KeyError(f"no refusal named {name!r}; known: {[r.name for r in REFUSALS]}")


def markdown() -> str:
    """``docs/refusals.md``."""
    lines = [
        "# What is refused, and why",
        "",
        "<!-- Generated from sharders/refusals.py: python -m sharders.refusals > docs/refusals.md -->",
        "",
        "Every other combination trains exactly as `torch.optim` on the unsharded model; the promise",
        "matrix (`make test-matrix`) samples them. Each of these is refused on every rank at once, before",
        "anything changes, with a message that names the table or the setting; except where the values",
        "trained bring it (\"the next step\"): that one is raised on every rank at once at the step after.",
        "",
        "| combination | refused at | why | instead |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {r.combination} | {r.stage} | {r.why} | {r.instead} |" for r in REFUSALS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
