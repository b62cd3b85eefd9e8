"""A training loop you can leave running: checkpoints every few steps (written in the
background), per-step metrics, and a restart that goes on where the job stopped.

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/train_long.py \\
        --out run --steps 40 --every 10
    python examples/train_long.py --out run --steps 40 --every 10      # 1 process

Run it twice with the same --out: the second run resumes from the last checkpoint under
run/ckpt and only trains the steps left. run/metrics.jsonl holds one JSON line per step
(the measured step time, tokens/s, MFU and peak memory beside the plan's); a line a person
reads is printed every --every steps. Each step's batch is drawn from the step's number,
so a resumed job sees the data it would have seen.
"""

import argparse
import functools
import os

import torch
import torch.nn.functional as F

import autopar
from autopar.models import build


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def batch(step: int, size: int = 8, seq: int = 32, vocab: int = 256):
    gen = torch.Generator().manual_seed(step)
    x = torch.randint(0, vocab, (size, seq + 1), generator=gen)
    return x[:, :-1], x[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="checkpoints and metrics go here")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="checkpoint and print every")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model, _ = build("gpt-tiny", batch=8, device="cpu", seed=0)
    engine = autopar.parallelize(
        model, world, example_inputs=(batch(0)[0],), loss_fn=lm_loss,
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-3),
        checkpoint_dir=os.path.join(args.out, "ckpt"), checkpoint_every=args.every,
        metrics=os.path.join(args.out, "metrics.jsonl"), metrics_every=args.every)
    if engine.steps and engine.global_rank() == 0:
        print(f"resumed at step {engine.steps}")
    while engine.steps < args.steps:
        engine.train_step(*batch(engine.steps))
    engine.wait_for_checkpoint()  # the last background save is on disk before we exit


if __name__ == "__main__":
    main()
