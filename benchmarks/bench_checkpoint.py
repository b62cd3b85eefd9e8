"""Checkpoint save and load at world 4: time, bytes written, and exactness of a reshard.

    python benchmarks/bench_checkpoint.py [--model gpt:layers=4,hidden=256,...] [--batch 8]
                                          [--plans "data 4" "tensor 4" ...]

Spawns a gloo world of 4 local processes. For each plan, an engine trains one AdamW step
(so the optimizer has state) and saves (`Engine.save`: each rank writes the boxes of the
whole tensors it holds; replicas are written once); the save is timed on every rank
between barriers and the slowest rank reported, and the bytes are those of the published
directory's files. A fresh engine (other initial weights) under the same plan loads it,
timed the same way; then one under the next plan of the list loads it (a reshard: other
slices, other ZeRO pieces) and saves it again at once, and the whole weights and whole
optimizer states of the two checkpoints are compared element by element (the largest
absolute difference: 0 when the reshard is exact). Beside them, the gathered baseline:
`full_state_dict()` (whole weights on every rank, the optimizer state not included) and
`torch.save` of it on rank 0. Then, in one process, the cost of reading DCP metadata
without running code: the `.metadata` of a 48-layer model saved over 64 ranks (every
weight and AdamW moment in 64 chunks) read by autopar's safe reader (parse into inert
records, schema and bounds checks, data files stat-ed) beside the plain `pickle.load` DCP
itself would do, best of 3. Then saves in the background (`--async-plan`): the step alone,
after a blocking save, and with a background save in flight, and the time to resume from a
checkpoint directory. Prints tables and writes benchmarks/results/checkpoint.json.
"""

import argparse
import functools
import json
import math
import os
import pickle
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gloo_world import lm_loss, results_path, run_world  # noqa: E402

MODEL = "gpt:layers=4,hidden=256,heads=8,vocab=1024,seq=64"
PLANS = {"data 4": {"data": 4},
         "tensor 4": {"tensor": {"size": 4, "mode": "1d"}},
         "2d 2x2": {"tensor": {"size": 4, "mode": "2d"}},
         "data 2 x tensor 2 zero 1": {"data": 2, "tensor": {"size": 2, "mode": "1d"},
                                      "zero": {"stage": 1}},
         "data 4 zero 2": {"data": 4, "zero": {"stage": 2}}}


def engine_for(spec: str, plan: dict, batch: int, seed: int):
    import autopar
    from autopar.models import build

    model, (x,) = build(spec, batch=batch, device="cpu", seed=seed)
    return autopar.parallelize(model, dist.get_world_size(), example_inputs=(x[:2],),
                               loss_fn=lm_loss, plan=plan,
                               optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))


def timed(fn):
    """fn() between barriers; the slowest rank's seconds."""
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return out, float(took)


def dir_bytes(path: str) -> tuple[int, int]:
    files = [os.path.join(path, f) for f in os.listdir(path)]
    return sum(os.path.getsize(f) for f in files), len(files)


def max_difference(a: str, b: str) -> tuple[float, float]:
    """Largest absolute difference of the whole weights, and of the whole optimizer
    states, of two checkpoints (inf when their keys differ)."""
    from autopar.runtime.checkpoint import load_full_optimizer_state, load_full_state_dict

    wa, wb = load_full_state_dict(a), load_full_state_dict(b)
    sa, sb = load_full_optimizer_state(a), load_full_optimizer_state(b)
    if list(wa) != list(wb) or set(sa) != set(sb):
        return float("inf"), float("inf")
    weights = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    states = 0.0
    for name in sa:
        if set(sa[name]) != set(sb[name]):
            return weights, float("inf")
        for key, v in sa[name].items():
            w = sb[name][key]
            states = max(states, float((torch.as_tensor(v) - torch.as_tensor(w)).abs().max()))
    return weights, states


def worker(rank, spec, batch, plan_names, scratch, out_path):
    warnings.filterwarnings("ignore")
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i, name in enumerate(plan_names):
        nxt = plan_names[(i + 1) % len(plan_names)]
        root = os.path.join(scratch, name.replace(" ", "_"))
        engine = engine_for(spec, PLANS[name], batch, seed=0)
        x = torch.randint(0, 1024, (batch, 64), generator=gen)
        engine.train_step(x, x.roll(-1, 1))
        published, save_s = timed(lambda engine=engine, root=root: engine.save(root))
        whole, gather_s = timed(engine.full_state_dict)
        baseline = os.path.join(scratch, "whole.pt")
        t0 = time.perf_counter()
        if rank == 0:
            torch.save(whole, baseline)
        torch_save_s = time.perf_counter() - t0
        fresh = engine_for(spec, PLANS[name], batch, seed=1)
        _, load_s = timed(lambda fresh=fresh, root=root: fresh.load(root))
        other = engine_for(spec, PLANS[nxt], batch, seed=1)
        _, reshard_s = timed(lambda other=other, root=root: other.load(root))
        resaved = other.save(root + "_resaved")
        row = None
        if rank == 0:
            nbytes, files = dir_bytes(published)
            weights, states = max_difference(published, resaved)
            row = {"plan": name, "reshard_to": nxt, "save_s": save_s, "load_s": load_s,
                   "reshard_load_s": reshard_s, "bytes": nbytes, "files": files,
                   "gather_s": gather_s, "torch_save_s": torch_save_s,
                   "whole_weights_bytes": os.path.getsize(baseline),
                   "max_abs_diff_weights": weights, "max_abs_diff_optimizer": states}
            rows.append(row)
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(root + "_resaved", ignore_errors=True)
        dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": 4, "model": spec, "batch": batch, "device": "cpu (gloo)",
                       "rows": rows}, f, indent=1)


def synthetic_checkpoint(path: str, layers: int = 48, hidden: int = 1024,
                         ranks: int = 64) -> int:
    """Write DCP metadata (as DCP's writer pickles it) of a GPT-like model saved over
    `ranks` ranks, with sparse data files of the right lengths; returns the chunk count."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    shapes = {"attn.qkv.weight": (3 * hidden, hidden), "attn.qkv.bias": (3 * hidden,),
              "attn.proj.weight": (hidden, hidden), "attn.proj.bias": (hidden,),
              "mlp.fc1.weight": (4 * hidden, hidden), "mlp.fc1.bias": (4 * hidden,),
              "mlp.fc2.weight": (hidden, 4 * hidden), "mlp.fc2.bias": (hidden,),
              "ln_1.weight": (hidden,), "ln_1.bias": (hidden,), "ln_2.weight": (hidden,),
              "ln_2.bias": (hidden,)}
    tensors, storage, ends = {}, {}, [0] * ranks
    props = TensorProperties(dtype=torch.float32)
    for layer in range(layers):
        for name, shape in shapes.items():
            for kind in ("model/", "optim/", "optim/"):
                fqn = f"{kind}blocks.{layer}.{name}" + ("" if kind == "model/" else
                                                        f"/exp_avg{len(tensors) % 2}")
                rows = shape[0] // ranks
                chunks = []
                for r in range(ranks):
                    offsets = torch.Size([r * rows] + [0] * (len(shape) - 1))
                    sizes = torch.Size([rows] + list(shape[1:]))
                    chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
                    length = 4 * math.prod(sizes) + 1024  # torch.save's framing
                    storage[MetadataIndex(fqn, offsets, r)] = _StorageInfo(
                        f"__{r}_0.distcp", ends[r], length)
                    ends[r] += length
                tensors[fqn] = TensorStorageMetadata(props, torch.Size(shape), chunks)
    metadata = Metadata(state_dict_metadata=tensors, storage_data=storage,
                        storage_meta=StorageMeta(checkpoint_id=path), version="1.0.0")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    for r, end in enumerate(ends):
        with open(os.path.join(path, f"__{r}_0.distcp"), "wb") as f:
            f.truncate(end)  # sparse: only the lengths matter to the reader
    return sum(len(md.chunks) for md in tensors.values())


def metadata_read(scratch: str) -> dict:
    """Seconds to read the synthetic metadata safely and with plain pickle (best of 3)."""
    from autopar.runtime.safe_metadata import read_metadata

    path = os.path.join(scratch, "synthetic")
    os.makedirs(path)
    chunks = synthetic_checkpoint(path)

    def plain():
        with open(os.path.join(path, ".metadata"), "rb") as f:  # our own file: trusted
            return pickle.load(f)

    times = {"safe_s": [], "pickle_s": []}
    for _ in range(3):  # interleaved, so both see the same machine load
        for key, fn in (("safe_s", lambda: read_metadata(path)), ("pickle_s", plain)):
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    return {"layers": 48, "ranks": 64, "chunks": chunks,
            "bytes": os.path.getsize(os.path.join(path, ".metadata")),
            **{key: min(t) for key, t in times.items()}}


def async_worker(rank, spec, batch, plan_name, scratch, rounds, out_path):
    """One plan: the step alone, the step after a blocking save, the step with a background
    save in flight (the save's staging included), and the time to resume from the
    directory (parallelize with checkpoint_dir, beside parallelize without it)."""
    import statistics

    warnings.filterwarnings("ignore")
    gen = torch.Generator().manual_seed(1)
    root = os.path.join(scratch, "async")
    engine = engine_for(spec, PLANS[plan_name], batch, seed=0)
    x = torch.randint(0, 1024, (batch, 64), generator=gen)
    y = x.roll(-1, 1)
    engine.train_step(x, y)  # the optimizer has state: what a save writes
    none, blocking, overlapped, staged, joined = [], [], [], [], []
    for _ in range(rounds):
        none.append(timed(lambda: engine.train_step(x, y))[1])
        blocking.append(timed(lambda: (engine.save(root), engine.train_step(x, y)))[1])
        handle, took = timed(lambda: (engine.save(root, asynchronous=True),
                                      engine.train_step(x, y))[0])
        overlapped.append(took)
        staged.append(handle.staged_s)
        joined.append(timed(engine.wait_for_checkpoint)[1])
    _, fresh_s = timed(lambda: engine_for(spec, PLANS[plan_name], batch, seed=1))

    def resume():
        import autopar
        from autopar.models import build

        model, (x0,) = build(spec, batch=batch, device="cpu", seed=1)
        return autopar.parallelize(model, dist.get_world_size(), example_inputs=(x0[:2],),
                                   loss_fn=lm_loss, plan=PLANS[plan_name],
                                   optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                   checkpoint_dir=root)

    resumed, resume_s = timed(resume)
    if rank == 0:
        med = statistics.median
        with open(out_path, "w") as f:
            json.dump({"plan": plan_name, "rounds": rounds, "step_s": med(none),
                       "blocking_save_and_step_s": med(blocking),
                       "async_save_and_step_s": med(overlapped),
                       "staging_s": med(staged), "write_after_step_s": med(joined),
                       "start_s": fresh_s, "start_and_resume_s": resume_s,
                       "resumed_step": resumed.steps}, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--async-plan", default="data 4 zero 2", choices=list(PLANS),
                        help="the plan the background-save rows run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    out_path = results_path("checkpoint.json")
    with tempfile.TemporaryDirectory(prefix="autopar-bench-ckpt-") as scratch:
        run_world(worker, (args.model, args.batch, args.plans, scratch, out_path), 4)
        with open(out_path) as f:
            result = json.load(f)
        result["metadata_read"] = metadata_read(scratch)
        async_path = results_path("checkpoint_async.json")
        run_world(async_worker, (args.model, args.batch, args.async_plan, scratch,
                                 args.rounds, async_path), 4)
        with open(async_path) as f:
            result["async"] = json.load(f)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{args.model}, world 4 (gloo, CPU), AdamW after one step; times are the slowest "
          "rank's")
    header = (f"{'plan':<26} {'save s':>7} {'load s':>7} {'MiB':>7} {'files':>5}  "
              f"{'reshard load into':<26} {'s':>6} {'max|dw|':>8} {'max|dopt|':>9}  "
              f"{'gather+torch.save s':>19}")
    print(header)
    print("-" * len(header))
    for r in result["rows"]:
        print(f"{r['plan']:<26} {r['save_s']:>7.3f} {r['load_s']:>7.3f} "
              f"{r['bytes'] / 2**20:>7.2f} {r['files']:>5}  {r['reshard_to']:<26} "
              f"{r['reshard_load_s']:>6.3f} {r['max_abs_diff_weights']:>8.1e} "
              f"{r['max_abs_diff_optimizer']:>9.1e}  "
              f"{r['gather_s'] + r['torch_save_s']:>19.3f}")
    print("MiB: the published checkpoint (weights and AdamW state, each element once); "
          "gather+torch.save: full_state_dict on every rank, then rank 0 writes the whole "
          "weights (no optimizer state)")
    m = result["metadata_read"]
    print(f"\nDCP metadata of a {m['layers']}-layer model over {m['ranks']} ranks: "
          f"{m['chunks']} chunks, "
          f"{m['bytes'] / 2**20:.1f} MiB; read without running code (autopar) "
          f"{m['safe_s']:.3f} s, plain pickle.load (DCP's own reader) {m['pickle_s']:.3f} s, "
          f"x{m['safe_s'] / m['pickle_s']:.1f}")
    a = result["async"]
    print(f"\nsaves in the background ({a['plan']}, median of {a['rounds']}; slowest rank):")
    print(f"  step alone                                {a['step_s']:.3f} s")
    print(f"  blocking save, then the step              {a['blocking_save_and_step_s']:.3f} s")
    print(f"  background save (staging {a['staging_s']:.3f} s), then the step "
          f"{a['async_save_and_step_s']:.3f} s ({a['async_save_and_step_s'] / a['blocking_save_and_step_s']:.2f}x "
          f"the blocking one); the write went on {a['write_after_step_s']:.3f} s after it")
    print(f"  resume: parallelize with checkpoint_dir {a['start_and_resume_s']:.3f} s beside "
          f"{a['start_s']:.3f} s without (resumed at step {a['resumed_step']})")
    print(f"written to {os.path.relpath(out_path, ROOT)}")


if __name__ == "__main__":
    main()
