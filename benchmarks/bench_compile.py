"""Step time compiled against eager, and against torch's engines compiled: FSDP2 and DTensor.

    python benchmarks/bench_compile.py [--quick] [--world 4] [--batch 8] [--steps 5]

One gloo world on this machine. Every rank builds the same model from one seed and trains
it on the same global batch with AdamW under each engine of a group, eager and with
`compile=True` (inductor, one compiled region per repeated block, collectives outside):

    data      autopar data, eager and compiled    beside FSDP2 + torch.compile per block
    zero3     autopar ZeRO-3, eager and compiled  beside FSDP2 + torch.compile per block
    tensor    autopar tensor 1D, eager, compiled  beside DTensor TP + torch.compile per block
    pipeline  autopar 1F1B pp2 x dp, eager and compiled

The peers compile each block as torchtitan does (torch.compile(block, fullgraph=True)
before sharding). The GPT groups run a GPT of 110M parameters (--quick: 4 small blocks);
the tensor group runs a LLaMA of the same width, whose separate q, k, v projections
DTensor's ColwiseParallel splits by heads (a fused QKV weight would be split across q, k
and v). Engines take turns step by step; each row reports its first step (compile
included), the median of the measured steps, the ratio to eager autopar and to the
compiled peer (median over rounds of the pair's step-time ratio), and the peak resident
memory a step adds on rank 0 (VmHWM after the step minus VmRSS before it). Prints a table;
writes benchmarks/results/compile_world<N>.json.
"""

import argparse
import copy
import ctypes
import functools
import gc
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gloo_world import (  # noqa: E402
    dtensor_tensor_parallel,
    eager_step,
    lm_loss,
    results_path,
    run_world,
    world_mean,
)

MODELS = {  # (GPT, LLaMA for the tensor group)
    "full": ("gpt:layers=12,hidden=768,heads=12,vocab=32768,seq=64",
             "llama:layers=12,hidden=768,heads=12,kv_heads=12,ffn=2048,vocab=32768,seq=64"),
    "quick": ("gpt:layers=4,hidden=256,heads=8,vocab=2048,seq=64",
              "llama:layers=4,hidden=256,heads=8,kv_heads=8,ffn=688,vocab=2048,seq=64"),
}
PEER = {"data": "FSDP2 + compile", "zero3": "FSDP2 + compile",
        "tensor": "DTensor TP + compile", "pipeline": None}
PLANS = {"data": lambda w: {"data": w}, "zero3": lambda w: {"data": w, "zero": {"stage": 3}},
         "tensor": lambda w: {"tensor": {"size": w, "mode": "1d"}},
         "pipeline": lambda w: {"pipeline": {"size": 2, "schedule": "1f1b",
                                             "microbatches": 4}}}


def _model(spec: str, batch: int):
    from autopar.models import build

    model, (x,) = build(spec, batch=batch, device="cpu", seed=0)
    vocab = next(m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding))
    gen = torch.Generator().manual_seed(1)
    return model, torch.randint(0, vocab, x.shape, generator=gen), \
        torch.randint(0, vocab, x.shape, generator=gen)


def _autopar(model, world, plan, x, y, compile):
    import autopar

    engine = autopar.parallelize(copy.deepcopy(model), world, example_inputs=(x[:2],),
                                 loss_fn=lm_loss, plan=plan, compile=compile,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
    return functools.partial(engine.train_step, x, y)


def _compile_blocks(model):
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, fullgraph=True)
    return model


def _peer(group: str, model, world: int, x, y):
    if group == "tensor":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        tp = _compile_blocks(dtensor_tensor_parallel(copy.deepcopy(model), mesh, world))
        return eager_step(tp, torch.optim.AdamW(tp.parameters(), lr=1e-4), x, y, float)
    from torch.distributed.fsdp import fully_shard

    fsdp = _compile_blocks(copy.deepcopy(model))
    for block in fsdp.blocks:
        fully_shard(block)
    fully_shard(fsdp)
    rank, n = dist.get_rank(), x.shape[0] // world
    return eager_step(fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-4),
                      x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n], world_mean)


def _engines(group: str, specs, world: int, batch: int) -> dict:
    model, x, y = _model(specs[1] if group == "tensor" else specs[0], batch)
    rows = {f"autopar {group} eager": _autopar(model, world, PLANS[group](world), x, y, False),
            f"autopar {group} compiled": _autopar(model, world, PLANS[group](world), x, y, True)}
    if PEER[group]:
        rows[PEER[group]] = _peer(group, model, world, x, y)
    return rows


def _step_memory(run) -> int:
    """Bytes of resident memory one step adds at its peak on this process."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = _status("VmRSS")
    run()
    return _status("VmHWM") - before


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        line = next(s for s in f if s.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def _timed(engines: dict, steps: int) -> tuple[dict, dict, dict]:
    first, times, losses = {}, {row: [] for row in engines}, {}
    for step in range(1 + steps):
        for row, run in list(engines.items())[::1 if step % 2 == 0 else -1]:
            dist.barrier()
            start = time.perf_counter()
            losses[row] = run()
            dist.barrier()
            seconds = time.perf_counter() - start
            if step:
                times[row].append(seconds)
            else:  # the first step compiles
                first[row] = seconds
    return first, times, losses


def _paired(times: dict, row: str, other) -> float | None:
    """The median over rounds of `row`'s step time over `other`'s in the same round."""
    if other is None or other == row:
        return None
    return statistics.median(a / b for a, b in zip(times[row], times[other]))


def worker(rank, world, specs, batch, steps, groups, out_path):
    warnings.filterwarnings("ignore")
    # inductor compiles in this process: a pool of compile workers per rank (each a torch
    # import, hundreds of MiB) would be four pools on a 2-core machine
    from torch._inductor import config as inductor

    inductor.compile_threads = 1
    rows = []
    for group in groups:
        engines = _engines(group, specs, world, batch)
        first, times, losses = _timed(engines, steps)
        memory = {row: _step_memory(run) for row, run in engines.items()}
        eager, peer = f"autopar {group} eager", PEER[group]
        for row in engines:
            rows.append({"group": group, "engine": row, "first_step_s": first[row],
                         "median_s": statistics.median(times[row]), "times_s": times[row],
                         "vs_eager": _paired(times, row, eager),
                         "vs_peer": _paired(times, row, peer) if "autopar" in row else None,
                         "step_memory_bytes": memory[row], "loss": losses[row]})
        # an engine's parameters, gradients and optimizer state sit in reference cycles: only
        # the cyclic collector frees them, and it counts objects, not bytes, so without this
        # the groups' engines piled up (the 110M run held eleven and was killed for memory)
        del engines
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": world, "models": specs, "batch": batch, "steps": steps,
                       "device": "cpu (gloo)", "threads_per_rank": torch.get_num_threads(),
                       "rows": rows}, f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="4 small blocks, not 110M")
    parser.add_argument("--groups", nargs="+", default=list(PLANS), choices=list(PLANS))
    args = parser.parse_args()
    specs = MODELS["quick" if args.quick else "full"]
    out_path = results_path(f"compile_world{args.world}.json")
    run_world(worker, (args.world, specs, args.batch, args.steps, args.groups, out_path),
              args.world)
    with open(out_path) as f:
        result = json.load(f)
    print(f"{specs[0]} (tensor: {specs[1]}), world {args.world} (gloo, CPU), global batch "
          f"{args.batch}, AdamW; median of {args.steps} steps after the first, taking turns")
    print(f"{'engine':<26} {'1st step s':>10} {'step s':>8} {'/eager':>7} {'/peer':>7} "
          f"{'step MiB':>9} {'last loss':>10}")
    for r in result["rows"]:
        cols = (f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("vs_eager", "vs_peer"))
        print(f"{r['engine']:<26} {r['first_step_s']:>10.2f} {r['median_s']:>8.3f} "
              f"{next(cols):>7} {next(cols):>7} {r['step_memory_bytes'] / 2**20:>9.1f} "
              f"{r['loss']:>10.5f}")
    print(f"written to {out_path}")


if __name__ == "__main__":
    main()
