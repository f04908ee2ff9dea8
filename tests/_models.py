"""Tiny TorchRec models and data shared by the tests (not collected by pytest)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

ROWS = 12
DIM = 4
TABLES = ("t0", "t1")


class TinyModel(nn.Module):
    """Two EmbeddingBag tables (``ebc.embedding_bags["t0"|"t1"]``) and an MLP."""

    def __init__(self, device: str | torch.device = "cpu", seed: int = 0, rows: int = ROWS) -> None:
        super().__init__()
        torch.manual_seed(seed)
        configs = [
            EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f_{t}"])
            for t in TABLES
        ]
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device(device))
        self.dense = nn.Sequential(nn.Linear(2 * DIM, 8, device=device), nn.Tanh(), nn.Linear(8, 1, device=device))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(kjt)
        return self.dense(torch.cat([pooled[f"f_{t}"] for t in TABLES], dim=1)).squeeze(1)


def make_batch(generator: torch.Generator, batch: int = 6) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """A batch with 1-3 ids per feature per sample, and a target per sample."""
    lengths = torch.randint(1, 4, (len(TABLES) * batch,), generator=generator)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=generator)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{t}" for t in TABLES], values=values, lengths=lengths
    )
    return kjt, torch.randn(batch, generator=generator)


def loss_of(model: nn.Module, batch: tuple[KeyedJaggedTensor, torch.Tensor]) -> torch.Tensor:
    kjt, target = batch
    return (model(kjt) - target).pow(2).mean()


def clone_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_params(model: nn.Module, reference: nn.Module, step: int) -> None:
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.detach(), ref[name].detach(), rtol=1e-5, atol=1e-6,
            msg=lambda m, name=name: f"step {step}, {name}: {m}",
        )


def assert_moved(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    """Every parameter changed, so a parity check did not pass by standing still."""
    for name, param in model.named_parameters():
        moved = (param.detach() - before[name]).abs().max().item()
        assert moved > 1e-4, f"{name} moved only {moved}: the comparison proves nothing"


class ManyTableModel(nn.Module):
    """``len(names)`` tables ``ebc.embedding_bags[name]`` (one feature ``f_<name>`` each) and an MLP."""

    def __init__(self, names: list[str], rows: int = ROWS, dim: int = 8, seed: int = 0, device: str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.names = list(names)
        configs = [
            EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f_{n}"])
            for n in self.names
        ]
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device(device))
        self.dense = nn.Sequential(nn.Linear(len(names) * dim, 4, device=device), nn.Tanh(),
                                   nn.Linear(4, 1, device=device))

    @property
    def tables(self) -> nn.ModuleDict:
        return self.ebc.embedding_bags

    @staticmethod
    def table_key(name: str) -> str:
        return f"ebc.embedding_bags.{name}.weight"

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(kjt)
        return self.dense(torch.cat([pooled[f"f_{n}"] for n in self.names], dim=1)).squeeze(1)


def covering_batch(
    names: list[str], generator: torch.Generator, batch: int = 4, rows: int = ROWS, cover: bool = True
) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Per feature: sample 0's bag holds every row when ``cover`` (so every row is
    touched), the other samples 1-3 random ids."""
    lengths, values = [], []
    for _ in names:
        for sample in range(batch):
            if cover and sample == 0:
                ids = torch.randperm(rows, generator=generator)
            else:
                ids = torch.randint(0, rows, (int(torch.randint(1, 4, (1,), generator=generator)),), generator=generator)
            lengths.append(ids.numel())
            values.append(ids)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{n}" for n in names], values=torch.cat(values), lengths=torch.tensor(lengths)
    )
    return kjt, torch.randn(batch, generator=generator)


def concat_batches(parts: list[tuple[KeyedJaggedTensor, torch.Tensor]]) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """The global batch: every rank's samples, rank after rank, for each feature."""
    keys = parts[0][0].keys()
    lengths, values = [], []
    for key in keys:
        for kjt, _ in parts:
            jt = kjt[key]
            lengths.append(jt.lengths())
            values.append(jt.values())
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
    return kjt, torch.cat([t for _, t in parts])


class ManySequenceModel(nn.Module):
    """``len(names)`` tables of an EmbeddingCollection, ``ec.embeddings[name]`` (one feature
    ``f_<name>`` each), and an MLP. Each sample's ids are weighted by their position,
    ``1 / (1 + position)``, and summed: every id's row gets its own gradient, as in a sequence
    model, which pooling would not give."""

    def __init__(self, names: list[str], rows: int = ROWS, dim: int = 8, seed: int = 0, device: str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.names = list(names)
        configs = [
            EmbeddingConfig(name=n, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f_{n}"])
            for n in self.names
        ]
        self.ec = EmbeddingCollection(tables=configs, device=torch.device(device))
        self.dense = nn.Sequential(nn.Linear(len(names) * dim, 4, device=device), nn.Tanh(),
                                   nn.Linear(4, 1, device=device))

    @property
    def tables(self) -> nn.ModuleDict:
        return self.ec.embeddings

    @staticmethod
    def table_key(name: str) -> str:
        return f"ec.embeddings.{name}.weight"

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        sequences = self.ec(kjt)
        return self.dense(torch.cat([position_weighted(sequences[f"f_{n}"]) for n in self.names], dim=1)).squeeze(1)


def position_weighted(jt) -> torch.Tensor:
    """``[batch, dim]``: each sample's rows times ``1 / (1 + position)``, summed."""
    lengths, values = jt.lengths(), jt.values()
    sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(values.shape[0]) - starts[sample]
    weighted = values / (1.0 + position.to(values.dtype))[:, None]
    return values.new_zeros(lengths.numel(), values.shape[1]).index_add(0, sample, weighted)


class MixedModel(nn.Module):
    """An EmbeddingBagCollection (``ebc``) and an EmbeddingCollection (``ec``) in one model, and
    an MLP: tables named ``ec_...`` go to the EC (position-weighted, as ``ManySequenceModel``),
    the others to the EBC (sum-pooled). One feature ``f_<name>`` per table."""

    def __init__(self, names: list[str], rows: int = ROWS, dim: int = 8, seed: int = 0, device: str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.names = list(names)
        bags = [n for n in names if not n.startswith("ec_")]
        sequences = [n for n in names if n.startswith("ec_")]
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f_{n}"]) for n in bags
        ], device=torch.device(device))
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name=n, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f_{n}"]) for n in sequences
        ], device=torch.device(device))
        self.dense = nn.Sequential(nn.Linear(len(names) * dim, 4, device=device), nn.Tanh(),
                                   nn.Linear(4, 1, device=device))

    @property
    def tables(self) -> dict[str, nn.Module]:
        return {**self.ebc.embedding_bags, **self.ec.embeddings}

    @staticmethod
    def table_key(name: str) -> str:
        return f"ec.embeddings.{name}.weight" if name.startswith("ec_") else f"ebc.embedding_bags.{name}.weight"

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        bag_names = [n for n in self.names if not n.startswith("ec_")]
        seq_names = [n for n in self.names if n.startswith("ec_")]
        pooled = self.ebc(KeyedJaggedTensor.from_jt_dict({f"f_{n}": kjt[f"f_{n}"] for n in bag_names}))
        sequences = self.ec(KeyedJaggedTensor.from_jt_dict({f"f_{n}": kjt[f"f_{n}"] for n in seq_names}))
        parts = {**{n: pooled[f"f_{n}"] for n in bag_names}, **{n: position_weighted(sequences[f"f_{n}"]) for n in seq_names}}
        return self.dense(torch.cat([parts[n] for n in self.names], dim=1)).squeeze(1)


@contextlib.contextmanager
def without_compiled_operators() -> Iterator[None]:
    """As where the compiled extension (overlap_optim/csrc) was not built: every caller takes its
    pure-torch path, fused tables FBGEMM's own backward. For models built inside the block."""
    import overlap_optim.row_pass
    import overlap_optim.virtual_groups
    import sharders.fused_rows

    names = [(overlap_optim.row_pass, "_ADAM_ROWS"), (overlap_optim.virtual_groups, "_ADD_ONE"),
             (sharders.fused_rows, "_STEP"), (sharders.fused_rows, "_COALESCE"), (sharders.fused_rows, "_APPLY")]
    kept = [getattr(module, name) for module, name in names]
    for module, name in names:
        setattr(module, name, None)
    try:
        yield
    finally:
        for (module, name), value in zip(names, kept):
            setattr(module, name, value)
