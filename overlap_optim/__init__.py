"""overlap-optim: per-parameter optimizers that run during backward, exactly as torch.optim.

Annotate parameters once with :func:`apply_optimizer_in_backward`; gather every
annotated parameter into one keyed, checkpointable optimizer with
:func:`get_optimizers`.
"""

from overlap_optim import checkpoint
from overlap_optim.accumulation import no_step
from overlap_optim.clipping import GradientClipping, apply_gradient_clipping
from overlap_optim.annotation import AnnotationGroup, apply_optimizer_in_backward, materialize
from overlap_optim.ddp import register_optimizer_hook
from overlap_optim.fsdp import fully_shard
from overlap_optim.local_sgd import QSR
from overlap_optim.spec import OptimizerSpec, describe_optimizer
from overlap_optim.keyed import InBackwardOptimizer, get_optimizers, unoptimized_parameters

__all__ = [
    "AnnotationGroup",
    "checkpoint",
    "InBackwardOptimizer",
    "apply_optimizer_in_backward",
    "apply_gradient_clipping",
    "GradientClipping",
    "describe_optimizer",
    "fully_shard",
    "OptimizerSpec",
    "QSR",
    "get_optimizers",
    "materialize",
    "no_step",
    "register_optimizer_hook",
    "unoptimized_parameters",
]
