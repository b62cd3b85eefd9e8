"""The NCCL path end to end on the GPUs this machine has, in one command.

    python benchmarks/gpu_check.py [--world N] [--device cuda|cpu] [--backend nccl|gloo]
                                   [--steps 3] [--timing-steps 10] [--quick]

On a machine with GPUs (world = the GPUs it finds unless --world says fewer; one GPU:
world 1) one process per GPU joins an NCCL group and checks:

    equal     a small LLaMA in bf16 (fp32 masters) trained under data, tensor, ZeRO-3 and
              pipeline plans, whichever the world allows, against the same model trained
              on one device under torch.autocast(bf16): every step's loss within 2%
    memory    a GPT built on the meta device and started under ZeRO-3 over the world:
              each rank's torch.cuda.max_memory_allocated over the start and two AdamW
              steps beside the plan's predicted bytes per rank, at most 10% over
    time      step time of autopar ZeRO-3 beside FSDP2 (fully_shard per block) and of
              autopar tensor 1D beside DTensor's parallelize_module (world > 1)

One table, benchmarks/results/gpu_check.json, exit status 1 on a mismatch (a loss off
or memory over; times are reported, not judged). Without a GPU it prints a note and
exits 0. `--device cpu --backend gloo` runs the same checks on CPU processes (memory
then reads the live tensor bytes after the steps, as no allocator peak exists there):
tests/test_gpu_check.py runs it at world 2 with --quick.
"""

import argparse
import copy
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
    live_tensor_bytes,
    lm_loss,
    results_path,
    run_world,
)

# separate q, k, v projections: what DTensor's ColwiseParallel splits by heads
MODEL = "llama:layers=4,hidden=256,heads=8,kv_heads=8,ffn=688,vocab=2048,seq=64"
META_MODEL = "gpt:layers=8,hidden=1024,heads=16,vocab=16384,seq=128"
QUICK_MODEL = "llama:layers=2,hidden=64,heads=4,kv_heads=4,ffn=128,vocab=256,seq=16"
QUICK_META_MODEL = "gpt:layers=2,hidden=128,heads=4,vocab=512,seq=32"
BATCH = 8
LOSS_TOLERANCE = 0.02  # bf16 compute: relative difference of a step's loss
MEMORY_TOLERANCE = 0.10  # measured over predicted per-rank bytes, at most


def plans_for(world: int) -> dict[str, dict]:
    """The plans a world of `world` ranks runs: data always; tensor, ZeRO-3 over two or
    more; a two-stage pipeline (data over the rest) on an even world."""
    plans = {f"data {world}": {"data": world}}
    if world > 1:
        plans[f"tensor {world}"] = {"tensor": {"size": world, "mode": "1d"}}
        plans[f"zero3 {world}"] = {"data": world, "zero": {"stage": 3}}
    if world % 2 == 0:
        plans[f"pipeline 2 x data {world // 2}"] = {
            "pipeline": {"size": 2, "schedule": "1f1b", "microbatches": 2},
            "data": world // 2}
    return plans


def loss_error(losses: list[float], reference: list[float]) -> float:
    """The largest relative difference of a step's loss from the reference's."""
    if len(losses) != len(reference):
        raise ValueError(f"{len(losses)} losses against {len(reference)} reference losses")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def memory_ratio(measured: int, predicted: int) -> float:
    """Measured bytes per rank over the plan's prediction."""
    return measured / predicted


def judge(rows: list[dict]) -> list[str]:
    """The rows that fail: an `equal` row beyond LOSS_TOLERANCE, a `memory` row over
    1 + MEMORY_TOLERANCE; `time` rows are not judged."""
    bad = []
    for row in rows:
        if row["check"] == "equal" and not row["value"] <= LOSS_TOLERANCE:
            bad.append(f"{row['name']}: loss off by {row['value']:.2%}")
        if row["check"] == "memory" and not row["value"] <= 1 + MEMORY_TOLERANCE:
            bad.append(f"{row['name']}: {row['value']:.2f}x the predicted bytes")
    return bad


def _model(spec: str, device: torch.device):
    from autopar.models import build

    model, (x,) = build(spec, batch=BATCH, device="cpu", seed=0)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, x.shape, generator=gen)
    return model.to(device), x.to(device), torch.randint(0, vocab, x.shape, generator=gen) \
        .to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eager_step(model, opt, x, y, device: torch.device) -> float:
    """One plain step under torch.autocast(bf16) on fp32 weights; the mean loss over the
    world (each rank's is the same under a replicated reference)."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = lm_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def _median_step(step, n: int, device: torch.device) -> float:
    times = []
    for i in range(n + 2):  # two warm-up steps
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _equal_rows(world, device, spec, steps, timing_steps, adamw) -> tuple[list, dict]:
    """One `equal` row per plan, and the engines the timing rows reuse."""
    import autopar

    model, x, y = _model(spec, device)
    single = copy.deepcopy(model)
    opt = adamw(single.parameters())
    reference = [_eager_step(single, opt, x, y, device) for _ in range(steps)]
    rows, engines = [], {}
    for name, plan in plans_for(world).items():
        engine = autopar.parallelize(copy.deepcopy(model), world, example_inputs=(x[:2],),
                                     loss_fn=lm_loss, optimizer=adamw, plan=plan,
                                     precision="bf16")
        losses = [engine.train_step(x, y) for _ in range(steps)]
        rows.append({"check": "equal", "name": f"{name} vs one device",
                     "value": loss_error(losses, reference), "losses": losses,
                     "reference": reference})
        if "zero3" in name or "tensor" in name:
            engines[name.split()[0]] = functools.partial(engine.train_step, x, y)
    return rows, engines


def _memory_row(world, device, spec, adamw) -> dict:
    """A meta-built GPT under ZeRO-3: the most a rank held beside the plan's prediction."""
    import autopar
    from autopar.models import build
    from autopar.world import World, local_device

    model, (x,) = build(spec, batch=BATCH)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, x.shape, generator=torch.Generator().manual_seed(1))
    plan = autopar.plan(model, (x.to("meta"),),
                        World(devices=world, per_node=world, device=local_device()),
                        global_batch=BATCH, loss_fn=lm_loss, example_target=x.to("meta"),
                        executable=True, top=1,
                        constraints=dict(dp=world, tp=1, pp=1, zero=3 if world > 1 else 0,
                                         recompute="none", sp="none", offload=False))
    x = x.to(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    engine = autopar.parallelize(model, world, example_inputs=(x[:2],), loss_fn=lm_loss,
                                 optimizer=adamw, plan=plan, seed=0)
    for _ in range(2):
        engine.train_step(x, x.roll(-1, 1))
    if device.type == "cuda":
        measured, what = torch.cuda.max_memory_allocated(device) - base, \
            "max_memory_allocated"
    else:
        measured, what = live_tensor_bytes(), "live tensor bytes after the steps"
    predicted = int(plan.predicted["memory_per_device_bytes"])
    return {"check": "memory", "name": f"meta start, zero3 {world}",
            "value": memory_ratio(measured, predicted), "measured": measured,
            "predicted": predicted, "what": what}


def _peer_steps(world, device, spec, adamw) -> dict:
    """FSDP2 and DTensor tensor-parallel steps on the same model and batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, x, y = _model(spec, device)
    rank, n = dist.get_rank(), BATCH // world
    fsdp = copy.deepcopy(model)
    for block in fsdp.blocks:
        fully_shard(block)
    fully_shard(fsdp)
    mine = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    steps = {"FSDP2": functools.partial(_eager_step, fsdp, adamw(fsdp.parameters()), *mine,
                                        device)}
    mesh = init_device_mesh(device.type, (world,))
    dt = dtensor_tensor_parallel(copy.deepcopy(model), mesh, world)
    steps["DTensor TP"] = functools.partial(_eager_step, dt, adamw(dt.parameters()), x, y,
                                            device)
    return steps


def worker(rank, args, out_path):
    warnings.filterwarnings("ignore")
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    spec, meta_spec = (QUICK_MODEL, QUICK_META_MODEL) if args.quick else \
        (MODEL, META_MODEL)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    rows, engines = _equal_rows(args.world, device, spec, args.steps, args.timing_steps,
                                adamw)
    rows.append(_memory_row(args.world, device, meta_spec, adamw))
    if args.world > 1:
        peers = _peer_steps(args.world, device, spec, adamw)
        for ours, theirs in (("zero3", "FSDP2"), ("tensor", "DTensor TP")):
            mine = _median_step(engines[ours], args.timing_steps, device)
            peer = _median_step(peers[theirs], args.timing_steps, device)
            rows.append({"check": "time", "name": f"autopar {ours} vs {theirs}",
                         "value": mine / peer, "autopar_s": mine, "peer_s": peer})
    gathered = [None] * args.world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": args.world, "device": args.device, "backend": args.backend,
                       "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                       "model": spec, "meta_model": meta_spec, "ranks": gathered}, f,
                      indent=2)


def merge(ranks: list[list[dict]]) -> list[dict]:
    """Per row, the worst rank's value (equal and memory are judged on it)."""
    out = []
    for rows in zip(*ranks):
        worst = max(rows, key=lambda r: r["value"])
        out.append({**worst, "rank": rows.index(worst)})
    return out


def print_table(result: dict, rows: list[dict]) -> None:
    print(f"gpu_check: world {result['world']} on {result['gpu'] or result['device']} "
          f"({result['backend']}); model {result['model']}, meta model {result['meta_model']}")
    print(f"{'check':<7} {'what':<58} {'value':>9} {'detail'}")
    for r in rows:
        if r["check"] == "equal":
            detail = f"max loss diff {r['value']:.2%} (tolerance {LOSS_TOLERANCE:.0%})"
        elif r["check"] == "memory":
            detail = (f"{r['measured'] / 2**20:.1f} MiB measured ({r['what']}) / "
                      f"{r['predicted'] / 2**20:.1f} MiB predicted")
        else:
            detail = f"{r['autopar_s'] * 1e3:.1f} ms / {r['peer_s'] * 1e3:.1f} ms"
        print(f"{r['check']:<7} {r['name']:<58} {r['value']:>9.3f} {detail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=None,
                        help="processes (default: the GPUs found; 2 on --device cpu)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                        help="default: nccl on cuda, gloo on cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timing-steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny models (for tests)")
    args = parser.parse_args(argv)
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda":
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found == 0:
            print("gpu_check: no GPU on this machine, nothing checked (run it where "
                  "torch.cuda.device_count() > 0, or pass --device cpu --backend gloo).")
            return 0
        args.world = min(args.world or found, found)
    args.world = args.world or 2
    out_path = results_path("gpu_check.json")
    run_world(worker, (args, out_path), args.world, backend=args.backend)
    with open(out_path) as f:
        result = json.load(f)
    rows = merge(result["ranks"])
    result["rows"] = rows
    bad = judge(rows)
    result["failed"] = bad
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    print_table(result, rows)
    for line in bad:
        print(f"MISMATCH {line}", file=sys.stderr)
    print(f"written to {out_path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
