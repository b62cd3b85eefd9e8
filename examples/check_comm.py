"""Check that every byte a training step sends is logged and priced: the zoo's tiny GPT under
a plan, a few steps, and on every rank `engine.comm_log.totals()` beside
`engine.predicted_comm(batch)` per (collective, mesh axis).

    torchrun --standalone --nproc-per-node 4 examples/check_comm.py   # pipeline 2 x tensor 2
    python examples/check_comm.py                                     # 1 process

Rank 0 prints its table (and what `engine.startup_log` holds: the pipeline's weight fetch
and torch's one-time handshake, outside the step); the script exits with status 1 when any
rank's measured bytes differ from the prediction. See docs/communication.md.
"""

import argparse
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.models import build


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default=None,
                        help="a plan as JSON, e.g. '{\"pipeline\": 2, \"data\": 2}' (default: "
                             "pipeline 2 x tensor 2 on 4 processes, one device on 1)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    plan = json.loads(args.plan) if args.plan else \
        dict(pipeline=dict(size=2, microbatches=2), tensor=2) if world == 4 else None
    model, (x,) = build("gpt-tiny", batch=args.batch, device="cpu", seed=0)
    engine = autopar.parallelize(model, world, example_inputs=(x,), loss_fn=lm_loss,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                 plan=plan)
    torch.manual_seed(1)
    data = torch.randint(0, 64, (args.batch, x.shape[1] + 1))
    same = True
    for _ in range(args.steps):
        engine.comm_log.clear()
        engine.train_step(data[:, :-1], data[:, 1:])
        measured, predicted = engine.comm_log.totals(), engine.predicted_comm(args.batch)
        same = same and measured == predicted
    if engine.global_rank() == 0:
        print(f"{'collective':<16}{'axis':<7}{'measured':>12}{'predicted':>12}   (bytes, "
              "one step, rank 0)")
        for op, axis in sorted(set(measured) | set(predicted)):
            print(f"{op:<16}{axis:<7}{measured.get((op, axis), 0):>12}"
                  f"{predicted.get((op, axis), 0):>12}")
        for (op, axis), nbytes in sorted(engine.startup_log.totals().items()):
            print(f"startup: {op} on {axis}, {nbytes} bytes")
    agreed = torch.tensor([0 if same else 1])
    if world > 1:
        dist.all_reduce(agreed)
    if engine.global_rank() == 0:
        print("every rank: measured equals predicted" if agreed.item() == 0 else
              f"{agreed.item()} rank(s) measured other bytes than predicted")
    if world > 1:
        dist.destroy_process_group()
    return 0 if agreed.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
