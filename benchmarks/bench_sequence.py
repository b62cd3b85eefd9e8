"""Sequence (context) parallelism: activation memory per rank, and the longest sequence.

    python benchmarks/bench_sequence.py [--seqs 4096 8192 16384] [--batch 1]
                                        [--cap-mib 512] [--skip-memory] [--skip-reach]

(a) Memory. A small GPT from the zoo (`MEMORY_SPEC`, dropout 0) trains at each sequence
length on one device (a gloo world of 1), with ring attention over cp = 4 and with Ulysses
over cp = 4 (a gloo world of 4, dp = 1). Each run trains one warm-up step (it traces the
training graph and makes the AdamW state), then measures a second: the activations are
the distinct storages autograd saves during `train_step` (`measure_saved_activations`,
parameters, buffers and the caller's batch left out), per rank. The prediction is
`autopar.cost.memory.activation_bytes` on the engine's own training graph and solution
(`engine.train_graph`, `engine.train_solution`) at the engine's batch. The table gives both,
their ratio, and the measured share of the single-device run (1/cp would be perfect).

Ring attention runs in its default zigzag layout (rank r holds chunks r and 2c-1-r of 2c),
Ulysses in contiguous blocks. The loss takes each rank's own tokens (the cross-entropy of
this rank's rows; only the loss sum and the token count are summed over cp), so the
logits are never gathered. What stays above 1/cp: one attention-output copy per block
(below); the position table is a parameter (whole on every rank, and its gradient is whole
too), not an activation.

(b) Reach. The longest sequence one train_step (forward, backward, AdamW step) runs under
a per-process memory cap, ring attention over 4 ranks against one device, for
`REACH_SPEC` (batch 1). Per-process memory is measured, not modelled: the growth of the
process's resident set during the step (the high-water mark is reset by writing "5" to
/proc/self/clear_refs right before, and VmHWM read from /proc/self/status right after,
minus VmRSS before). The engine is built and its training graph traced before the reset
(`Engine.ensure_train_graph`), so tracing is outside the step. The workers run with
glibc's mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_), so every large tensor is
its own mapping, returned when freed: the resident set follows live tensors instead of a
heap that keeps freed blocks. The model at each probe is built for that sequence length
(`seq=` in the spec), so its position table grows with it; the parameters are resident
before the step (printed beside, the same on both sides: cp keeps weights whole), while
gradients and the AdamW state (made by this first step, once the activations are freed)
count in the step. Under cp the step's peak is the largest over the 4 ranks. Search:
doubling from `--reach-start` tokens, then bisection, on multiples of `--reach-block`
tokens (a multiple of 4 * cp), up to `--reach-max`.

What this machine shows (CPU, gloo, float32): (a) the prediction matches what autograd
saves within 0.02%, and each rank holds 0.264 of the single-device activations (1/cp =
0.25; the loss layer exactly 0.25): the ring and Ulysses kernels return their output
contiguous in [B, H, S, D] where aten's CPU flash attention returns it laid out
[B, S, H, D], so the model's transpose + reshape copies it and c_proj saves the copy (one
[B, S/cp, hidden] per block). Before the loss took its own tokens (it gathered the logits
over cp) the share was 0.342. (b) ring attention on 4 ranks (zigzag layout, the kernel
tiled so each ring step works on tiles of at most TILE x TILE scores, as FlashAttention
does inside a block, and the loss on each rank's own tokens) trained 52224 tokens under
the 512 MiB cap against 13312 on one device: 3.92x. The step's peak grows linearly with
the sequence on both sides (about 10 KiB per token per rank under ring, 37 KiB on one
device). Earlier: 0.92x when the kernel materialised the S_local x S_local scores of
every block pair for all heads at once; 3.2x (43008 tokens) when the loss still gathered
the logits over cp.

Context, not a claim reproduced here: Li et al. 2021 (arXiv 2105.13120) report ring
attention reaching 3.0x the longest sequence of tensor parallelism on 64 GPUs.

Writes benchmarks/results/sequence.json.
"""

import argparse
import functools
import gc
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_world import lm_loss, results_path, run_world  # noqa: E402

CP = 4
MEMORY_SPEC = "gpt:layers=2,hidden=64,heads=4,vocab=256"
REACH_SPEC = "gpt:layers=2,hidden=256,heads=2,vocab=256"
MODES = ("single", "ring", "ulysses")


def _plan(mode: str):
    return {"data": 1} if mode == "single" else {"sequence": {"size": CP, "mode": mode}}


def _engine(spec: str, block_size: int, seq: int, batch: int, mode: str, world: int):
    import autopar
    from autopar.models import build

    model, (x,) = build(f"{spec},seq={block_size}", batch=batch, seq=seq, device="cpu",
                        seed=0)
    target = torch.randint(0, 256, x.shape, generator=torch.Generator().manual_seed(1))
    engine = autopar.parallelize(model, world, example_inputs=(x[:1],), loss_fn=lm_loss,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                 plan=_plan(mode))
    del model
    return engine, x, target


# ------------------------------------------------------------------ (a) activation memory
def memory_worker(rank, world, mode, seqs, batch, out_path):
    from autopar.cost.memory import activation_bytes
    from autopar.runtime.measure import measure_saved_activations

    warnings.filterwarnings("ignore", category=FutureWarning)
    rows = []
    for seq in seqs:
        engine, x, target = _engine(MEMORY_SPEC, seq, seq, batch, mode, world)
        t0 = time.perf_counter()
        engine.train_step((x,), target)  # warm-up: traces the training graph, AdamW state
        held = list(engine.parameters()) + [b for gm in (engine.forward_gm, engine.train_gm)
                                            for b in gm.buffers()]
        measured = measure_saved_activations(functools.partial(engine.train_step, (x,), target),
                                             exclude=held, inputs=(x, target))
        seconds = (time.perf_counter() - t0) / 2
        per_layer = activation_bytes(engine.train_graph, engine.train_solution, batch)
        every = [None] * world
        dist.all_gather_object(every, measured)
        rows.append({"mode": mode, "seq": seq, "batch": batch, "world": world,
                     "measured": every, "predicted": sum(per_layer.values()),
                     "predicted_layers": per_layer, "seconds_per_step": seconds})
        del engine
        gc.collect()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)


def run_memory(seqs, batch) -> list[dict]:
    rows = []
    for mode in MODES:
        world = 1 if mode == "single" else CP
        part = results_path(f"sequence_{mode}.json")
        run_world(memory_worker, (world, mode, seqs, batch, part), world)
        with open(part) as f:
            rows += json.load(f)
        os.remove(part)
    return rows


# ------------------------------------------------------------------ (b) reach
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def step_peak(engine, x, target) -> tuple[int, int]:
    """(peak resident growth during one train_step, resident bytes before it)."""
    inputs = engine.batches.local((x, target))
    engine.ensure_train_graph(inputs[:1], inputs[1])  # trace before the measured step
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    engine.train_step((x,), target)
    return _status("VmHWM") - before, before


def reach_worker(rank, world, mode, cap, start, block, max_seq, out_path):
    warnings.filterwarnings("ignore", category=FutureWarning)
    probes = []

    def fits(seq: int) -> bool:
        engine, x, target = _engine(REACH_SPEC, seq, seq, 1, mode, world)
        t0 = time.perf_counter()
        peak, rest = step_peak(engine, x, target)
        seconds = time.perf_counter() - t0
        del engine, x, target
        gc.collect()
        peaks = torch.tensor([peak, rest], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        probes.append({"seq": seq, "peak": int(peaks[0]), "resting": int(peaks[1]),
                       "fits": bool(peaks[0] <= cap), "seconds": seconds})
        if rank == 0:
            print(f"  [{mode}] seq {seq:>6}: step peak {peaks[0] / 2**20:7.1f} MiB "
                  f"({'fits' if peaks[0] <= cap else 'over'}, {seconds:.1f} s)", flush=True)
        return bool(peaks[0] <= cap)

    lo, hi = 0, None  # lo fits (0: nothing yet), hi does not
    seq = start
    while seq <= max_seq:
        if fits(seq):
            lo, seq = seq, seq * 2
        else:
            hi = seq
            break
    if hi is None:
        hi = max_seq + block  # never failed: the search is capped, not the memory
    while hi - lo > block:
        mid = (lo + hi) // 2 // block * block
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"mode": mode, "world": world, "max_seq": lo,
                       "capped_by_search": lo >= max_seq, "probes": probes}, f)


def run_reach(cap, start, block, max_seq) -> list[dict]:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # inherited by the workers
    rows = []
    for mode, world in (("single", 1), ("ring", CP)):
        part = results_path(f"sequence_reach_{mode}.json")
        run_world(reach_worker, (world, mode, cap, start, block, max_seq, part), world)
        with open(part) as f:
            rows.append(json.load(f))
        os.remove(part)
    return rows


# ------------------------------------------------------------------ report
def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def print_memory(rows, batch):
    from autopar.models.zoo import config_of

    print(f"(a) activations per rank, {MEMORY_SPEC}, batch {batch}, cp = {CP}; MiB "
          "measured (largest over ranks) / predicted (ratio), share of the single-device "
          "run")
    single = {r["seq"]: max(r["measured"]) for r in rows if r["mode"] == "single"}
    print(f"{'seq':>6} {'mode':<8} {'measured':>10} {'predicted':>10} {'pred/meas':>9} "
          f"{'ranks min..max':>16} {'/ single':>8} {'s/step':>7}")
    worst = 0.0
    for r in sorted(rows, key=lambda r: (r["seq"], MODES.index(r["mode"]))):
        m = max(r["measured"])
        ratio = r["predicted"] / m
        worst = max(worst, abs(ratio - 1))
        share = m / single[r["seq"]] if r["seq"] in single else float("nan")
        print(f"{r['seq']:>6} {r['mode']:<8} {_mib(m):>10} {_mib(r['predicted']):>10} "
              f"{ratio:>9.4f} {_mib(min(r['measured'])) + '..' + _mib(m):>16} "
              f"{share:>8.3f} {r['seconds_per_step']:>7.1f}")
    print(f"largest prediction error: {worst:.2%}")
    print("above 1/cp (predicted, per rank): one attention-output copy per block (ring and "
          "Ulysses return [B, H, S, D]\ncontiguous, aten's CPU flash attention [B, S, H, D], so "
          "the model's transpose + reshape copies); the loss takes\nits own tokens' logits "
          "(only the loss sum and token count are summed over cp)")
    cfg = config_of(MEMORY_SPEC)
    for r in sorted(rows, key=lambda r: (r["seq"], MODES.index(r["mode"]))):
        if r["mode"] == "single":
            continue
        base = next(x for x in rows if x["mode"] == "single" and x["seq"] == r["seq"])
        copies = cfg.n_layer * batch * r["seq"] // CP * cfg.n_embd * 4
        loss = r["predicted_layers"].get("loss", 0)
        base_loss = base["predicted_layers"].get("loss", 0)
        over = r["predicted"] - base["predicted"] / CP
        print(f"  {r['seq']:>6} {r['mode']:<8} {r['predicted'] / base['predicted']:.3f} of the "
              f"single-device run (1/cp = {1 / CP:.3f}): {_mib(over)} MiB over 1/cp, of which {_mib(copies)} MiB the attention-output copies c_proj "
              f"saves; loss layer {loss / max(base_loss, 1):.3f} of one device's")

def print_reach(rows, cap):
    print(f"\n(b) longest sequence of one train_step (forward, backward, AdamW) under a cap of "
          f"{_mib(cap)} MiB peak resident growth per process; {REACH_SPEC}, batch 1")
    for r in rows:
        fit = [p for p in r["probes"] if p["seq"] == r["max_seq"]]
        peak = f"{_mib(fit[0]['peak'])} MiB at it" if fit else "none fits"
        rest = _mib(r["probes"][0]["resting"])
        flag = " (search ceiling, not memory)" if r["capped_by_search"] else ""
        label = "one device" if r["mode"] == "single" else f"ring, cp {CP}"
        print(f"  {label:<12} max sequence {r['max_seq']:>6}{flag}; peak {peak}; "
              f"resident before the step {rest} MiB")
    single, ring = (r["max_seq"] for r in rows)
    if single:
        print(f"  ratio ring / one device: {ring / single:.2f}x (target >= 3x)")
    from autopar.kernels.sequence import TILE
    from autopar.models.zoo import config_of

    heads = config_of(REACH_SPEC).n_head
    for r in rows[1:]:
        over = [p for p in r["probes"] if not p["fits"]]
        for p in ([q for q in r["probes"] if q["seq"] == r["max_seq"]] + over[-1:]):
            tile = min(TILE, p["seq"] // CP)
            block = heads * tile ** 2 * 4
            print(f"  ring at {p['seq']:>6}: one score tile of the ring kernel (all heads, "
                  f"float32, {tile} x {tile}) is {_mib(block)} MiB; step peak "
                  f"{_mib(p['peak'])} MiB")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 8192, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cap-mib", type=float, default=512)
    parser.add_argument("--reach-start", type=int, default=2048)
    parser.add_argument("--reach-block", type=int, default=1024)
    parser.add_argument("--reach-max", type=int, default=65536)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-reach", action="store_true")
    args = parser.parse_args()
    if args.reach_block % (4 * CP) or args.reach_start % args.reach_block:
        parser.error(f"--reach-block must be a multiple of {4 * CP} and divide --reach-start")
    result = {"device": "cpu (gloo)", "cp": CP, "memory_spec": MEMORY_SPEC,
              "reach_spec": REACH_SPEC, "batch": args.batch}
    out_path = results_path("sequence.json")
    previous = {}
    if os.path.exists(out_path):  # a section skipped now keeps its figures from the last run
        with open(out_path) as f:
            previous = json.load(f)
    same = all(previous.get(k) == result[k] for k in ("cp", "memory_spec", "reach_spec", "batch"))
    for section, skipped in (("memory", args.skip_memory), ("reach", args.skip_reach)):
        if skipped and same and section in previous:
            result[section] = previous[section]
    t0 = time.perf_counter()
    if not args.skip_memory:
        result["memory"] = run_memory(args.seqs, args.batch)
        print_memory(result["memory"], args.batch)
    if not args.skip_reach:
        cap = int(args.cap_mib * 2**20)
        result["reach"] = {"cap_bytes": cap, "metric": "peak RSS growth during train_step",
                           "rows": run_reach(cap, args.reach_start, args.reach_block,
                                             args.reach_max)}
        print_reach(result["reach"]["rows"], cap)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\n{time.perf_counter() - t0:.0f} s; written to {os.path.relpath(out_path, ROOT)}")


if __name__ == "__main__":
    main()
