"""The smallest useful overlap-optim program: one process, two tables, three optimizers.

A user table trained by Adagrad, an item table by SGD with momentum, and the
dense tower by Adam, all updated during backward. The same model is trained
beside it with plain torch.optim, and the script prints how far apart the two
end (they should agree to float precision).

Run: ``make demo``, or ``.venv/bin/python examples/minimal.py --steps 200``.
"""

from __future__ import annotations

import argparse
import copy
import logging
from pathlib import Path

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from tqdm import tqdm

from overlap_optim import apply_optimizer_in_backward, get_optimizers

log = logging.getLogger("minimal")
USERS, ITEMS, DIM = 500, 200, 8


class TwoTowerCTR(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="user", embedding_dim=DIM, num_embeddings=USERS, feature_names=["user"]),
                EmbeddingBagConfig(name="item", embedding_dim=DIM, num_embeddings=ITEMS, feature_names=["item"]),
            ]
        )
        self.dense = nn.Sequential(nn.Linear(2 * DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.ebc(kjt)
        return self.dense(torch.cat([pooled["user"], pooled["item"]], dim=1)).squeeze(1)


def synthetic_batch(generator: torch.Generator, batch: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Clicks that depend on a hidden user taste and item kind, so there is something to learn."""
    users = torch.randint(0, USERS, (batch,), generator=generator)
    items = torch.randint(0, ITEMS, (batch,), generator=generator)
    clicks = ((users % 4) == (items % 4)).float()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["user", "item"], values=torch.cat([users, items]), lengths=torch.ones(2 * batch, dtype=torch.long)
    )
    return kjt, clicks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="training steps (default 1000)")
    parser.add_argument("--batch-size", type=int, default=256, help="samples per step (default 256)")
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="output directory (default demo_out)")
    args = parser.parse_args()
    if args.steps < 1 or args.batch_size < 1:
        parser.error(f"--steps and --batch-size must be positive, got {args.steps} and {args.batch_size}")
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)

    torch.manual_seed(0)
    model = TwoTowerCTR()
    reference = copy.deepcopy(model)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.embedding_bags["user"].parameters(), {"lr": 0.1})
    apply_optimizer_in_backward(
        torch.optim.SGD, model.ebc.embedding_bags["item"].parameters(), {"lr": 0.5, "momentum": 0.9}
    )
    apply_optimizer_in_backward(torch.optim.Adam, model.dense.parameters(), {"lr": 3e-3})
    optimizer = get_optimizers(model)
    reference_optimizers = [
        torch.optim.Adagrad(reference.ebc.embedding_bags["user"].parameters(), lr=0.1),
        torch.optim.SGD(reference.ebc.embedding_bags["item"].parameters(), lr=0.5, momentum=0.9),
        torch.optim.Adam(reference.dense.parameters(), lr=3e-3),
    ]
    log.info("param groups: %s", [(g["optimizer"].rsplit(".", 1)[1], g["lr"], len(g["params"]))
                                  for g in optimizer.state_dict()["param_groups"]])

    loss_fn = nn.BCEWithLogitsLoss()
    generator = torch.Generator().manual_seed(1)
    progress = tqdm(range(args.steps), desc="training", unit="step")
    for step in progress:
        kjt, clicks = synthetic_batch(generator, args.batch_size)
        loss = loss_fn(model(kjt), clicks)
        loss.backward()  # each part is updated here, by its own optimizer
        loss_fn(reference(kjt), clicks).backward()
        for ref_opt in reference_optimizers:
            ref_opt.step()
            ref_opt.zero_grad()
        if step % 200 == 0 or step == args.steps - 1:
            progress.write(f"step {step:4d}  loss {loss.item():.4f}")

    gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    log.info("final loss %.4f; largest weight difference from plain torch.optim: %.2e", loss.item(), gap)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(optimizer.state_dict(), args.out / "minimal_optimizer.pt")
    log.info("optimizer state saved to %s", args.out / "minimal_optimizer.pt")


if __name__ == "__main__":
    main()
