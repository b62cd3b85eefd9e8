"""ZeRO-3 weight gathers outside a compiled block against the same gathers traced inside it.

    python benchmarks/bench_compile_gathers.py [--world 2] [--hidden 256] [--tokens 512] [--steps 10]

One gloo world on this machine. Each rank holds a 1/world shard (rows) of a block's two
4h x h weights and its own tokens; a step is forward and backward of
mean(gelu(x w1^T) w2^T)^2 under two variants, each with one torch.compile(fullgraph=True):

    outside  the shards are all-gathered eagerly before the compiled block and the full
             weights' gradients reduce-scattered (summed) after it: what compile=True does
    inside   the gathers are traced into the compiled block as functional collectives
             (all_gather_tensor_autograd, whose backward is the reduce-scatter)

The variants take turns step by step; the table reports each one's first step (compile
included), the median of the measured steps, the ratio inside / outside, and whether the
shards' gradients of the two are equal (every rank checks; exit status 1 if not). Writes
benchmarks/results/compile_gathers_world<N>.json.
"""

import argparse
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

RTOL, ATOL = 1e-5, 1e-7  # fp32: the two variants sum the same gradients in the same order


def _block(x, w1, w2):
    return (F.gelu(x @ w1.t()) @ w2.t()).square().mean()


def _outside(compiled, shards, x):
    world = dist.get_world_size()
    full = []
    for shard in shards:
        w = torch.empty((shard.shape[0] * world,) + tuple(shard.shape[1:]))
        dist.all_gather_into_tensor(w, shard.detach())
        full.append(w.requires_grad_())
    loss = compiled(x, *full)
    loss.backward()
    grads = []
    for w, shard in zip(full, shards):
        g = torch.empty_like(shard)
        dist.reduce_scatter_tensor(g, w.grad)
        grads.append(g)
    return loss.detach(), grads


def _inside_fn(x, s1, s2):
    from torch.distributed._functional_collectives import all_gather_tensor_autograd

    group = dist.group.WORLD
    return _block(x, all_gather_tensor_autograd(s1, 0, group),
                  all_gather_tensor_autograd(s2, 0, group))


def _inside(compiled, shards, x):
    leaves = [s.detach().requires_grad_() for s in shards]
    loss = compiled(x, *leaves)
    loss.backward()
    return loss.detach(), [s.grad for s in leaves]


def worker(rank, world, hidden, tokens, steps, out_path):
    warnings.filterwarnings("ignore")
    from torch._inductor import config as inductor

    inductor.compile_threads = 1  # one compile pool per rank would crowd a 2-core machine
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(4 * hidden, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(hidden, 4 * hidden, generator=gen) / (4 * hidden) ** 0.5
    shards = [w.chunk(world, 0)[rank].contiguous() for w in (w1, w2)]
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1 + rank))
    variants = {"outside": (_outside, torch.compile(_block, fullgraph=True)),
                "inside": (_inside, torch.compile(_inside_fn, fullgraph=True))}
    first, times, grads = {}, {v: [] for v in variants}, {}
    for step in range(1 + steps):
        for name, (run, compiled) in list(variants.items())[::1 if step % 2 == 0 else -1]:
            dist.barrier()
            start = time.perf_counter()
            _, grads[name] = run(compiled, shards, x)
            dist.barrier()
            seconds = time.perf_counter() - start
            if step:
                times[name].append(seconds)
            else:  # the first step compiles
                first[name] = seconds
    diff = max(float((a - b).abs().max()) for a, b in zip(grads["outside"], grads["inside"]))
    equal = all(torch.allclose(a, b, rtol=RTOL, atol=ATOL)
                for a, b in zip(grads["outside"], grads["inside"]))
    flag = torch.tensor([int(equal)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # equal on every rank
    if rank == 0:
        rows = [{"variant": v, "first_step_s": first[v], "median_s": statistics.median(times[v]),
                 "times_s": times[v]} for v in variants]
        with open(out_path, "w") as f:
            json.dump({"world": world, "hidden": hidden, "tokens": tokens, "steps": steps,
                       "weights": [list(w1.shape), list(w2.shape)], "device": "cpu (gloo)",
                       "threads_per_rank": torch.get_num_threads(), "rows": rows,
                       "inside_over_outside": statistics.median(
                           b / a for a, b in zip(times["outside"], times["inside"])),
                       "gradients_equal": bool(flag.item()), "max_grad_diff": diff,
                       "rtol": RTOL, "atol": ATOL}, f, indent=2)
    dist.barrier()
    # the process group's teardown after traced functional collectives hung on gloo here
    # (the results were written, the processes never exited): leave once both ranks are done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    out_path = results_path(f"compile_gathers_world{args.world}.json")
    run_world(worker, (args.world, args.hidden, args.tokens, args.steps, out_path), args.world)
    with open(out_path) as f:
        r = json.load(f)
    print(f"ZeRO-3 gathers of two 4h x h weights, h = {args.hidden}, {args.tokens} tokens per "
          f"rank, world {args.world} (gloo, CPU); forward + backward, median of {args.steps} "
          f"steps after the first, taking turns")
    print(f"{'gathers':<10} {'1st step s':>10} {'step s':>8}")
    for row in r["rows"]:
        print(f"{row['variant']:<10} {row['first_step_s']:>10.2f} {row['median_s']:>8.3f}")
    print(f"inside / outside (median of paired steps): {r['inside_over_outside']:.2f}")
    print(f"gradients equal: {'yes' if r['gradients_equal'] else 'no'} "
          f"(max |diff| {r['max_grad_diff']:.2e}, rtol {RTOL:g}, atol {ATOL:g})")
    print(f"written to {out_path}")
    if not r["gradients_equal"]:
        print("the shards' gradients differ between the variants", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
