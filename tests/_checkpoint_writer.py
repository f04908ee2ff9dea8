"""Saves checkpoints in a loop until killed (run as a script by test_checkpoint)."""

import sys

import torch

from overlap_optim import apply_optimizer_in_backward, checkpoint, get_optimizers

if __name__ == "__main__":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 1e-3})
    optimizer = get_optimizers(model)
    step = int(sys.argv[2])
    while True:
        model(torch.randn(4, 1024)).sum().backward()
        step += 1
        checkpoint.save(sys.argv[1], model, optimizer, {"step": step})
        print(step, flush=True)
