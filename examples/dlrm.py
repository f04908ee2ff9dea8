"""The demo's DLRM and its per-part optimizers, shared by the MovieLens and synthetic Criteo examples.

The model is TorchRec's own ``DLRM`` (an EmbeddingBagCollection, a bottom MLP
for the dense features, pairwise dot interactions, a top MLP) inside
``DLRMTrain``, which returns the loss as TorchRec's train pipelines expect.
One optimizer per part, each said once with ``apply_optimizer_in_backward``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from overlap_optim import apply_optimizer_in_backward

__all__ = ["build", "annotate", "dense_parameters", "reference_optimizers", "warmup_then_decay", "OPTIMIZERS"]

DIM = 16

# part -> (optimizer class, kwargs); which tables belong to which part is given by the caller
OPTIMIZERS = {
    "ids": (RowWiseAdagrad, {"lr": 0.05, "eps": 1e-8}),  # fused EXACT_ROWWISE_ADAGRAD
    "categorical": (torch.optim.SGD, {"lr": 0.05}),  # fused EXACT_SGD
    "bag": (torch.optim.Adam, {"lr": 0.005}),  # not fusable on CPU: the fallback
    "dense": (torch.optim.AdamW, {"lr": 0.002, "weight_decay": 1e-4}),  # from the DDP comm hook
}


def build(sizes: dict[str, int], dense_in: int, seed: int = 0, device: str | torch.device = "cpu") -> DLRMTrain:
    """A DLRMTrain with one table ``t_<feature>`` of ``sizes[feature]`` rows per sparse feature."""
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=n, feature_names=[f])
        for f, n in sizes.items()
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device(device))
    return DLRMTrain(DLRM(ebc, dense_in_features=dense_in, dense_arch_layer_sizes=[32, DIM],
                          over_arch_layer_sizes=[64, 32, 1], dense_device=torch.device(device)))


def dense_parameters(model: DLRMTrain) -> list[torch.nn.Parameter]:
    """The parameters of the MLPs (bottom and top): the dense part, every one but the tables'."""
    return [*model.model.dense_arch.parameters(), *model.model.over_arch.parameters()]


def _parts(model: DLRMTrain, parts: dict[str, list[str]]) -> dict[str, list[torch.nn.Parameter]]:
    bags = model.model.sparse_arch.embedding_bag_collection.embedding_bags
    out = {part: [bags[f"t_{f}"].weight for f in features] for part, features in parts.items()}
    out["dense"] = dense_parameters(model)
    return out


def annotate(model: DLRMTrain, parts: dict[str, list[str]]) -> None:
    """One ``apply_optimizer_in_backward`` call per part (``parts``: part -> sparse features)."""
    for part, params in _parts(model, parts).items():
        cls, kwargs = OPTIMIZERS[part]
        apply_optimizer_in_backward(cls, params, kwargs)


def reference_optimizers(model: DLRMTrain, parts: dict[str, list[str]]) -> list[torch.optim.Optimizer]:
    """The same settings as plain torch.optim optimizers, in the same order (the baseline)."""
    return [OPTIMIZERS[part][0](params, **OPTIMIZERS[part][1]) for part, params in _parts(model, parts).items()]


def warmup_then_decay(total_steps: int, warmup: int = 50) -> Callable[[int], float]:
    """Linear warmup, then a cosine decay to 10% of the rate at ``total_steps``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
    return factor
