"""Train the zoo GPT with autopar on local processes and print the loss each step.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py

Runs tensor size 2 x data size 2 on 4 processes (gloo on CPU, NCCL on GPUs).
"""

import functools
import os

import torch
import torch.nn.functional as F

import autopar
from autopar.models import build


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def main(steps: int = 10, batch: int = 8) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model, (x,) = build("gpt-tiny", batch=batch, device="cpu", seed=0)
    plan = {"tensor": {"size": 2, "mode": "1d"}} if world % 2 == 0 else None
    engine = autopar.parallelize(model, world, example_inputs=(x,), loss_fn=lm_loss,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=3e-3),
                                 plan=plan)
    torch.manual_seed(1)
    data = torch.randint(0, 64, (batch, x.shape[1] + 1))  # one fixed batch: loss must fall
    rank = int(os.environ.get("RANK", "0"))
    for step in range(steps):
        loss = engine.train_step(data[:, :-1], data[:, 1:])
        if rank == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
