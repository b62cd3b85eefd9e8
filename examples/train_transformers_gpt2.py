"""Train transformers' GPT-2 (built from a small config, no weights downloaded) with autopar.

    torchrun --standalone --nproc-per-node 4 examples/train_transformers_gpt2.py
    python examples/train_transformers_gpt2.py                                   # 1 process

The model is the library's own GPT2LMHeadModel, untouched: autopar traces it, the planner
chooses how to split it over the processes, and the loss function reads the ModelOutput
the model returns. Prints the plan and the loss of each step (rank 0).
"""

import argparse
import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import autopar

VOCAB = 1024


def lm_loss(out, target):
    """Next-token cross-entropy on the `logits` of GPT-2's ModelOutput."""
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:  # CPU processes talking over gloo, also on a machine with GPUs
        dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same initial weights on every rank
    config = GPT2Config(vocab_size=VOCAB, n_positions=args.seq, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    data = torch.randint(0, VOCAB, (args.batch, args.seq + 1))  # one fixed batch: loss must fall
    inputs, targets = data[:, :-1], data[:, 1:]
    engine = autopar.parallelize(model, world, example_inputs=(inputs,), loss_fn=lm_loss,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=3e-3))
    if rank == 0:  # the planner's choice, e.g. "pp1 dp2 cp1 tp2, tp 1d, ... zero 1"
        print(f"plan on {world} process{'es' if world > 1 else ''}: "
              f"{engine.plan.search['winner']}", flush=True)
    for step in range(args.steps):
        loss = engine.train_step(inputs, targets)
        if rank == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
