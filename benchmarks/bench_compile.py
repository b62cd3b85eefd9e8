"""Step time compiled against eager, and against torch's engines compiled: FSDP2 and DTensor.

    python benchmarks/bench_compile.py [--quick] [--world 4] [--batch 8] [--steps 4]
                                       [--optimizer sgd|adamw] [--groups data ...]

One gloo world on this machine. Every rank builds the same model from one seed and trains
it on the same global batch with the same optimizer (plain SGD unless --optimizer adamw)
under each engine of a group, eager and with `compile=True` (inductor, one compiled region
per repeated block, collectives outside):

    data      autopar data, eager and compiled    beside FSDP2 + torch.compile per block
    zero3     autopar ZeRO-3, eager and compiled  beside FSDP2 + torch.compile per block
    tensor    autopar tensor 1D, eager, compiled  beside DTensor TP + torch.compile per block
    pipeline  autopar 1F1B pp2 x dp, eager and compiled

The peers compile each block as torchtitan does (torch.compile(block, fullgraph=True)
before sharding). The GPT groups run a GPT of 110M parameters (--quick: 4 small blocks);
the tensor group runs a LLaMA of the same width, whose separate q, k, v projections
DTensor's ColwiseParallel splits by heads (a fused QKV weight would be split across q, k
and v).

At most two engines are alive at once (at 110M about 2 GiB a rank by count: two replicas
of the weights, one step's gradients, the process itself): first eager and compiled
autopar, then (the eager one freed) compiled autopar and the compiled peer. Each pair takes turns step by step for --steps rounds after every
engine's first step (compile included); a ratio is the median over rounds of the pair's
step-time ratio, and the peer's ratio to eager goes through compiled autopar, the engine
both pairs share. Every rank compiles in its own process with one compile thread, into a
cache of this run's own (so first steps are cold compiles). Each row reports its first
step, its median step, the ratios, the peak resident memory a step adds on rank 0 (VmHWM
after the step minus VmRSS before it) and the group's peak resident memory over all ranks.
Prints progress per group as it goes, writes benchmarks/results/compile_world<N>.json after
each group (a run stopped early keeps what it measured) and a table at the end.
"""

import argparse
import ctypes
import functools
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
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
# one optimizer for every engine. SGD holds no state: AdamW's two moments per parameter
# would put two data-parallel replicas of 110M parameters (the eager/compiled pair) at
# 3.5 GiB a rank, 14 GiB over four ranks
OPTIMIZERS = {"sgd": functools.partial(torch.optim.SGD, lr=1e-3),
              "adamw": functools.partial(torch.optim.AdamW, lr=1e-4)}


def _model(spec: str, batch: int):
    from autopar.models import build

    model, (x,) = build(spec, batch=batch, device="cpu", seed=0)
    vocab = next(m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding))
    gen = torch.Generator().manual_seed(1)
    return model, torch.randint(0, vocab, x.shape, generator=gen), \
        torch.randint(0, vocab, x.shape, generator=gen)


def _autopar(spec, world, plan, batch, compile, optimizer):
    import autopar
    from autopar.models import build

    model, x, y = _model(spec, batch)
    # the model on the meta device and its weights handed over as a mapping: an engine
    # given a real model keeps it whole in its traced graphs beside its own slices (a
    # second replica of 110M parameters per rank); this way the traced graphs hold meta
    # tensors and only the engine's slices are real
    weights = dict(model.state_dict())
    del model
    meta, _ = build(spec, batch=batch, device="meta", seed=0)
    engine = autopar.parallelize(meta, world, example_inputs=(x[:2],), loss_fn=lm_loss,
                                 plan=plan, compile=compile, optimizer=OPTIMIZERS[optimizer],
                                 weights=weights)
    return functools.partial(engine.train_step, x, y)


def _compile_blocks(model):
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, fullgraph=True)
    return model


def _peer(group: str, model, world: int, x, y, optimizer):
    make_optimizer = OPTIMIZERS[optimizer]
    if group == "tensor":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        tp = _compile_blocks(dtensor_tensor_parallel(model, mesh, world))
        return eager_step(tp, make_optimizer(tp.parameters()), x, y, float)
    from torch.distributed.fsdp import fully_shard

    fsdp = _compile_blocks(model)
    for block in fsdp.blocks:
        fully_shard(block)
    fully_shard(fsdp)
    rank, n = dist.get_rank(), x.shape[0] // world
    return eager_step(fsdp, make_optimizer(fsdp.parameters()),
                      x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n], world_mean)


def _engines(group: str, specs, world: int, batch: int, optimizer: str):
    """The group's engines as factories, each building the model afresh from one seed, so
    no replica outlives the engine that trains it."""
    spec = specs[1] if group == "tensor" else specs[0]
    plan = PLANS[group](world)

    def autopar_engine(compile):
        return _autopar(spec, world, plan, batch, compile, optimizer)

    def peer_engine():
        model, x, y = _model(spec, batch)
        return _peer(group, model, world, x, y, optimizer)

    return (functools.partial(autopar_engine, False), functools.partial(autopar_engine, True),
            peer_engine if PEER[group] else None)


def _step_memory(run) -> int:
    """Bytes of resident memory one step adds at its peak on this process."""
    _release()
    _reset_peak()
    before = _status("VmRSS")
    run()
    return _status("VmHWM") - before


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


def _release() -> None:
    """Free what dropped engines held: their parameters and gradients sit in reference
    cycles, which only the cyclic collector frees (it counts objects, not bytes), and glibc
    keeps freed heap pages until trimmed."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        line = next(s for s in f if s.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def _timed_step(run) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    loss = run()
    dist.barrier()
    return time.perf_counter() - start, loss


def _pair(a, b, steps: int) -> tuple[list, list, float, float]:
    """`steps` rounds of one step of a and one of b, the order alternating: both engines'
    step times and last losses."""
    times, losses = ([], []), [None, None]
    for step in range(steps):
        for i in ((0, 1) if step % 2 == 0 else (1, 0)):
            seconds, losses[i] = _timed_step((a, b)[i])
            times[i].append(seconds)
    return times[0], times[1], losses[0], losses[1]


def _ratio(a: list, b: list) -> float:
    """The median over rounds of a's step time over b's in the same round."""
    return statistics.median(x / y for x, y in zip(a, b))


def _resident_mib() -> float:
    """The peak resident memory of every rank together since the last reset, MiB."""
    value = torch.tensor([_status("VmHWM") / 2**20], dtype=torch.float64)
    dist.all_reduce(value)
    return float(value)


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _group(rank, world, group, specs, batch, steps, optimizer) -> list[dict]:
    """At most two engines alive at once: eager beside compiled autopar, then compiled
    autopar beside the compiled peer. The compiled engine is the member both pairs share:
    the peer's ratio to eager goes through it."""
    make_eager, make_compiled, make_peer = _engines(group, specs, world, batch, optimizer)
    eager_row, compiled_row = f"autopar {group} eager", f"autopar {group} compiled"
    rows, resident = {}, []
    _reset_peak()

    def first(row, run):
        seconds, loss = _timed_step(run)
        rows[row] = {"group": group, "engine": row, "first_step_s": seconds, "loss": loss}
        resident.append(_resident_mib())
        _say(rank, f"{group}: {row}, first step {seconds:.1f} s, all ranks' peak resident "
                   f"{resident[-1] / 1024:.2f} GiB")

    eager = make_eager()
    first(eager_row, eager)
    compiled = make_compiled()
    first(compiled_row, compiled)
    e_times, c_times, e_loss, c_loss = _pair(eager, compiled, steps)
    resident.append(_resident_mib())  # (before _step_memory resets the peak)
    rows[eager_row].update(times_s=e_times, loss=e_loss, vs_eager=1.0, vs_peer=None,
                           step_memory_bytes=_step_memory(eager))
    rows[compiled_row].update(times_s=c_times, loss=c_loss, vs_eager=_ratio(c_times, e_times),
                              vs_peer=None, step_memory_bytes=_step_memory(compiled))
    resident.append(_resident_mib())
    _say(rank, f"{group}: compiled / eager {rows[compiled_row]['vs_eager']:.3f} "
               f"(medians {statistics.median(c_times):.3f} / {statistics.median(e_times):.3f} s)")
    del eager
    _release()
    if make_peer is not None:
        peer_row = PEER[group]
        peer = make_peer()
        first(peer_row, peer)
        c2_times, p_times, _, p_loss = _pair(compiled, peer, steps)
        resident.append(_resident_mib())
        to_peer = _ratio(c2_times, p_times)
        rows[compiled_row].update(vs_peer=to_peer, times_beside_peer_s=c2_times)
        rows[peer_row].update(times_s=p_times, loss=p_loss, vs_peer=1.0,
                              vs_eager=rows[compiled_row]["vs_eager"] / to_peer,
                              step_memory_bytes=_step_memory(peer))
        resident.append(_resident_mib())
        _say(rank, f"{group}: compiled autopar / {peer_row} {to_peer:.3f} (medians "
                   f"{statistics.median(c2_times):.3f} / {statistics.median(p_times):.3f} s)")
        del peer
    del compiled
    _release()
    for row in rows.values():
        row["median_s"] = statistics.median(row["times_s"])
        row["peak_resident_all_ranks_mib"] = max(resident)
    return list(rows.values())


def worker(rank, world, specs, batch, steps, optimizer, groups, out_path):
    warnings.filterwarnings("ignore")
    # inductor compiles in this process: a pool of compile workers per rank (each a torch
    # import, hundreds of MiB) would be four pools on a 2-core machine
    from torch._inductor import config as inductor

    inductor.compile_threads = 1
    rows = []
    for group in groups:
        _say(rank, f"{group}: starting")
        rows += _group(rank, world, group, specs, batch, steps, optimizer)
        if rank == 0:  # after every group, so a run stopped early keeps what it measured
            with open(out_path, "w") as f:
                json.dump({"world": world, "models": specs, "batch": batch, "steps": steps,
                           "optimizer": optimizer, "device": "cpu (gloo)",
                           "threads_per_rank": torch.get_num_threads(), "rows": rows},
                          f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4,
                        help="measured rounds of each pair, after every engine's first step")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="sgd")
    parser.add_argument("--quick", action="store_true", help="4 small blocks, not 110M")
    parser.add_argument("--groups", nargs="+", default=list(PLANS), choices=list(PLANS))
    args = parser.parse_args()
    specs = MODELS["quick" if args.quick else "full"]
    out_path = results_path(f"compile_world{args.world}.json")
    # every rank compiles in its own process; a cold cache of this run's own, so the first
    # steps time inductor's codegen and not a hit left by an earlier run
    cache = tempfile.mkdtemp(prefix="bench_compile_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    try:
        run_world(worker, (args.world, specs, args.batch, args.steps, args.optimizer,
                           args.groups, out_path), args.world)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    with open(out_path) as f:
        result = json.load(f)
    print(f"{specs[0]} (tensor: {specs[1]}), world {args.world} (gloo, CPU), global batch "
          f"{args.batch}, {result['optimizer']}; {args.steps} rounds of each pair after the "
          f"first steps; ratios: median over rounds")
    print(f"{'engine':<26} {'1st step s':>10} {'step s':>8} {'/eager':>7} {'/peer':>7} "
          f"{'step MiB':>9} {'last loss':>10}")
    for r in result["rows"]:
        cols = (f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("vs_eager", "vs_peer"))
        print(f"{r['engine']:<26} {r['first_step_s']:>10.2f} {r['median_s']:>8.3f} "
              f"{next(cols):>7} {next(cols):>7} {r['step_memory_bytes'] / 2**20:>9.1f} "
              f"{r['loss']:>10.5f}")
    peaks = {r["group"]: r["peak_resident_all_ranks_mib"] for r in result["rows"]}
    print("peak resident memory over all ranks: " + ", ".join(
        f"{group} {mib / 1024:.2f} GiB" for group, mib in peaks.items()))
    print(f"written to {out_path}")


if __name__ == "__main__":
    main()
