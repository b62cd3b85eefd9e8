"""Step time beside torch's own data-parallel engines: DDP and FSDP2 (`fully_shard`).

    python benchmarks/bench_peers.py [--world 2] [--model gpt:layers=4,hidden=256,...]
                                     [--batch 16] [--steps 12] [--warmup 3]

One gloo world on this machine. Every rank builds the same model from one seed and
trains it, on the same global batch with AdamW, under each engine:

    autopar data 2          vs  DistributedDataParallel
    autopar ZeRO-1 / ZeRO-2 (for reference, beside DDP: their bytes equal an all-reduce)
    autopar ZeRO-3          vs  FSDP2 (fully_shard on every block, then on the model)

The engines take turns step by step (A B C ... A B C ...), so a burst of load from
elsewhere on the shared machine hits them alike; each row reports the median of the
measured steps and the ratio to its peer's median from the same run. The losses of the
last step are compared too (every engine trains the same model on the same data, so
they agree to float rounding). Prints a table; writes benchmarks/results/peers_world<N>.json.
"""

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gloo_world import results_path, run_world  # noqa: E402

MODEL = "gpt:layers=4,hidden=256,heads=8,vocab=2048,seq=64"
# row -> (what runs, its peer's row)
ROWS = {"autopar data": "DDP", "autopar zero 1": "DDP", "autopar zero 2": "DDP",
        "autopar zero 3": "FSDP2", "DDP": None, "FSDP2": None}


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _model(spec: str, batch: int):
    from autopar.models import build

    model, (x,) = build(spec, batch=batch, device="cpu", seed=0)
    gen = torch.Generator().manual_seed(1)
    vocab = model.cfg.vocab if hasattr(model, "cfg") and hasattr(model.cfg, "vocab") else \
        next(m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding))
    x = torch.randint(0, vocab, x.shape, generator=gen)
    y = torch.randint(0, vocab, x.shape, generator=gen)
    return model, x, y


def _engines(spec: str, world: int, batch: int) -> dict:
    """row -> a function running one training step on the global batch, returning the loss."""
    import autopar
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model, x, y = _model(spec, batch)
    rank, n = dist.get_rank(), batch // world
    mine = (x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4)
    steps = {}
    for row, zero in (("autopar data", 0), ("autopar zero 1", 1), ("autopar zero 2", 2),
                      ("autopar zero 3", 3)):
        engine = autopar.parallelize(copy.deepcopy(model), world, example_inputs=(x[:2],),
                                     loss_fn=lm_loss, optimizer=adamw,
                                     plan={"data": world, "zero": {"stage": zero}})
        steps[row] = functools.partial(engine.train_step, x, y)

    ddp = DistributedDataParallel(copy.deepcopy(model))
    ddp_opt = adamw(ddp.parameters())

    def ddp_step():
        loss = lm_loss(ddp(mine[0]), mine[1])
        loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=True)
        return _mean(loss)

    fsdp = copy.deepcopy(model)
    for block in fsdp.blocks:
        fully_shard(block)
    fully_shard(fsdp)
    fsdp_opt = adamw(fsdp.parameters())

    def fsdp_step():
        loss = lm_loss(fsdp(mine[0]), mine[1])
        loss.backward()
        fsdp_opt.step()
        fsdp_opt.zero_grad(set_to_none=True)
        return _mean(loss)

    steps["DDP"], steps["FSDP2"] = ddp_step, fsdp_step
    return steps


def _mean(loss: torch.Tensor) -> float:
    value = loss.detach().reshape(1).clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def worker(rank, world, spec, batch, steps, warmup, out_path):
    warnings.filterwarnings("ignore")
    engines = _engines(spec, world, batch)
    times = {row: [] for row in engines}
    losses = {}
    for step in range(warmup + steps):
        for row, run in engines.items():
            dist.barrier()
            start = time.perf_counter()
            losses[row] = run()
            dist.barrier()
            if step >= warmup:
                times[row].append(time.perf_counter() - start)
    if rank == 0:
        medians = {row: statistics.median(t) for row, t in times.items()}
        rows = []
        for row, peer in ROWS.items():
            rows.append({"engine": row, "peer": peer, "median_s": medians[row],
                         "times_s": times[row], "loss": losses[row],
                         "ratio": medians[row] / medians[peer] if peer else None})
        with open(out_path, "w") as f:
            json.dump({"world": world, "model": spec, "batch": batch, "steps": steps,
                       "warmup": warmup, "device": "cpu (gloo)",
                       "threads_per_rank": torch.get_num_threads(), "rows": rows}, f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    out_path = results_path(f"peers_world{args.world}.json")
    run_world(worker, (args.world, args.model, args.batch, args.steps, args.warmup, out_path),
              args.world)
    with open(out_path) as f:
        result = json.load(f)
    print(f"{args.model}, world {args.world} (gloo, CPU), global batch {args.batch}, AdamW; "
          f"median of {args.steps} steps after {args.warmup}, engines taking turns")
    print(f"{'engine':<16} {'step s':>9} {'peer':>7} {'ratio':>7} {'last loss':>11}")
    for row in result["rows"]:
        ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "-"
        print(f"{row['engine']:<16} {row['median_s']:>9.4f} {row['peer'] or '-':>7} "
              f"{ratio:>7} {row['loss']:>11.6f}")
    print(f"written to {out_path}")


if __name__ == "__main__":
    main()
