"""Train the zoo's tiny GPT with autopar on local processes and check it against one device.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py                  # planner
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --plan plan.json # a file
    python examples/train_gpt.py                                                    # 1 process

Prints the plan, then each step's loss beside the loss of the same model trained by plain
PyTorch on one device, and exits with status 1 if they differ by more than 1e-4. The
processes run on the CPU and talk over gloo.
"""

import argparse
import functools
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.models import build

LR = 3e-3


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def describe(plan: autopar.Plan) -> str:
    mesh = " ".join(f"{axis}={size}" for axis, size in plan.mesh.items())
    parts = [f"mesh {mesh}"]
    if plan.mesh["tp"] > 1:
        sp = " + Megatron-SP" if plan.sequence_parallel else ""
        parts.append(f"tensor {plan.tp_mode}{sp}")
    if plan.mesh["cp"] > 1:
        parts.append(f"sequence {plan.sequence_mode}")
    if plan.mesh["pp"] > 1:
        parts.append(f"pipeline {plan.pipeline.schedule} x {plan.pipeline.microbatches} "
                     "micro-batches")
    if plan.mesh["pp"] == 1 and plan.pipeline.microbatches > 1:
        parts.append(f"gradient accumulation over {plan.pipeline.microbatches} micro-batches")
    if plan.zero.stage:
        parts.append(f"ZeRO-{plan.zero.stage}" + (" with offload" if plan.zero.offload else ""))
    return ", ".join(parts)


def one_device_losses(batch: int, data: torch.Tensor, steps: int) -> list[float]:
    """The same model, data and optimizer in plain PyTorch on one device."""
    model, _ = build("gpt-tiny", batch=batch, device="cpu", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        loss = lm_loss(model(data[:, :-1]), data[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default=None,
                        help="a plan file from `autopar search -o` (default: the planner chooses)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:  # CPU processes talking over gloo, also on a machine with GPUs
        dist.init_process_group("gloo")
    model, (x,) = build("gpt-tiny", batch=args.batch, device="cpu", seed=0)
    engine = autopar.parallelize(model, world, example_inputs=(x,), loss_fn=lm_loss,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=LR),
                                 plan=args.plan)
    torch.manual_seed(1)
    data = torch.randint(0, 64, (args.batch, x.shape[1] + 1))  # one fixed batch: loss must fall
    if rank == 0:
        print(f"plan ({args.plan or 'chosen by the planner'}) on {world} "
              f"process{'es' if world > 1 else ''}: {describe(engine.plan)}")
        reference = one_device_losses(args.batch, data, args.steps)
        print("step   autopar   one device", flush=True)
    gap = 0.0
    for step in range(args.steps):
        loss = engine.train_step(data[:, :-1], data[:, 1:])
        if rank == 0:
            print(f"{step:4d}  {loss:8.4f}  {reference[step]:11.4f}", flush=True)
            gap = max(gap, abs(loss - reference[step]))
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank != 0:
        return 0
    if gap > 1e-4:
        print(f"the losses differ from one device's by up to {gap:.2e}", file=sys.stderr)
        return 1
    print(f"the losses match one device's (largest difference {gap:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
