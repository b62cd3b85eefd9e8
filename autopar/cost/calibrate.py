"""`autopar calibrate`: measure the machine it runs on and write a hardware profile.

Compute: matrix multiplications at several sizes, fitted to the profile's efficiency
curve ``efficiency = gemm_efficiency * F / (F + gemm_half_flops)``, and one large copy
for the memory bandwidth. Communication, when ``torch.distributed`` runs more than one
rank: all-reduce, all-gather, reduce-scatter, all-to-all, broadcast and point-to-point at
several message sizes, each fitted by least squares to its formula in
:mod:`autopar.cost.comm` for a per-collective alpha and beta (the profile's
``collectives``: the planner prices each collective inside a node with its own), and all
of them together for the link's alpha and beta. On a CPU the host an optimizer is
offloaded to is the same memory, so the host bandwidth is the measured copy rate, and
``compute_share`` records how the ranks share the cores (cores / (ranks x threads), at
most 1), since the rates measured with every rank busy are what each gets when all
compute. Facts that are not measured (memory size, the peak of a dtype it cannot time)
are kept from a built-in ``base`` profile, and the raw measurements go into the
profile's ``extra``.

Every rank measures and takes part in the collectives; all ranks agree on the numbers
and return the same profile, and rank 0 writes the file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from autopar.cost.comm import SYMBOLS, collective_expr, single_link
from autopar.cost.hardware import Hardware, load_hardware
from autopar.errors import WorldError
from autopar.modes import BF16, FP16, FP32, TF32

DTYPES = {FP32: torch.float32, BF16: torch.bfloat16, FP16: torch.float16}

# The formula each collective's measurements are fitted with: gloo and NCCL run rings
# (pairwise exchange for all-to-all) for large messages, and a two-rank broadcast is one
# message, which the binomial tree describes and the scatter + all-gather does not.
FIT_ALGORITHM = {"all_reduce": "ring", "all_gather": "ring", "reduce_scatter": "ring",
                 "all_to_all": "ring", "broadcast": "tree", "p2p": "direct"}


@dataclass(frozen=True)
class Effort:
    """What to measure and how long to time each point.

    Matmul sizes by device kind, the copy's size, the collectives' message sizes (bytes),
    and timing: batches of at least ``min_time`` seconds, the best of ``trials``.
    """

    matmul_dims: dict
    copy_bytes: int
    message_bytes: tuple[int, ...]
    min_time: float
    trials: int


# attention: sequence lengths, heads, head dim and tokens per call, by device kind
ATTENTION = {"cuda": ((1024, 2048, 4096, 8192), 32, 128, 8192),
             "cpu": ((64, 128, 256), 4, 32, 256)}
QUICK_ATTENTION = {"cuda": ((512, 1024), 8, 64, 1024), "cpu": ((16, 32), 2, 16, 32)}
COPY_CURVE = {"cuda": (2 ** 20, 2 ** 24, 2 ** 28, 2 ** 30), "cpu": (2 ** 16, 2 ** 20, 2 ** 24)}
QUICK_COPY_CURVE = {"cuda": (2 ** 20, 2 ** 24), "cpu": (2 ** 12, 2 ** 16)}

FULL = Effort({"cpu": (64, 128, 256, 512, 1024), "cuda": (512, 1024, 2048, 4096, 8192)},
              2 ** 28, (2 ** 10, 2 ** 14, 2 ** 18, 2 ** 22, 2 ** 26), 0.05, 5)
QUICK = Effort({"cpu": (16, 32, 64, 128), "cuda": (64, 256, 1024)},
               2 ** 22, (2 ** 8, 2 ** 12, 2 ** 16), 0.002, 3)


# ----------------------------------------------------------------------------- timing


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _device() -> torch.device:
    """The accelerator this rank drives: its GPU under NCCL (or alone), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if _world() == 1 or dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _mean_over_ranks(values: list[float], device: torch.device, world: int) -> list[float]:
    """Each value's mean over the ranks (every rank timed its own), so that all agree."""
    flat = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(flat)
    return (flat / world).tolist()


def _seconds_per_call(fn: Callable[[], object], device: torch.device, effort: Effort,
                      together: bool = False) -> float:
    """Best seconds per call of `fn` over `effort.trials` batches.

    With `together`, every rank runs the same number of calls, batches start at a
    barrier, and a batch lasts as long as its slowest rank: a collective is done when the
    last rank is.
    """
    def agreed(seconds: float) -> float:
        return _max_over_ranks(seconds, device) if together else seconds

    fn()  # first call: connections, allocator, caches
    once = math.inf
    for _ in range(effort.trials):  # the fastest single call sizes the batches
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        once = min(once, agreed(time.perf_counter() - start))
        if once >= effort.min_time:
            return once  # one call is a whole batch already
    calls = max(1, min(1000, math.ceil(effort.min_time / max(once, 1e-9))))
    best = math.inf
    for _ in range(effort.trials):
        if together:
            dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        best = min(best, agreed(time.perf_counter() - start) / calls)
    return best


# ----------------------------------------------------------------------------- fitting


def _fit_two(rows: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Non-negative least squares of ``x * a + y * b = 1`` over rows ``(a, b)``."""
    saa = sum(a * a for a, _ in rows)
    sbb = sum(b * b for _, b in rows)
    sab = sum(a * b for a, b in rows)
    sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    if det > 0:
        x, y = (sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det
        if x >= 0 and y >= 0:
            return x, y
    candidates = [(sa / saa if saa else 0.0, 0.0), (0.0, sb / sbb if sbb else 0.0)]
    return min(candidates, key=lambda c: sum((c[0] * a + c[1] * b - 1) ** 2 for a, b in rows))


def fit_gemm(flops: Sequence[float], seconds: Sequence[float]) -> tuple[float, float, float]:
    """``(peak, gemm_efficiency, gemm_half_flops)`` from matmuls of ``flops`` taking ``seconds``.

    Fits ``1 / rate = (1 + half / F) / top`` with each point weighted by its relative
    error. The peak is the larger of the best observed rate and the fitted top rate, so
    the efficiency never exceeds one.
    """
    rates = [f / s for f, s in zip(flops, seconds)]
    a, b = _fit_two([(r, r / f) for r, f in zip(rates, flops)])
    best = max(rates)
    top = 1.0 / a if a > 0 else best
    peak = max(best, top)
    return peak, top / peak, b * top


def _coefficients(op: str, nbytes: float, world: int) -> tuple[float, float]:
    """What alpha and beta are multiplied by in the formula the measurements are fitted to."""
    s = SYMBOLS
    expr = single_link(collective_expr(op, FIT_ALGORITHM[op]))
    at = {s.n: nbytes, s.p: world}
    return float(expr.diff(s.alpha).subs(at)), float(expr.diff(s.beta).subs(at))


def fit_alpha_beta(samples: Sequence[tuple[str, float, float]], world: int) -> tuple[float, float]:
    """Latency and seconds per byte that best explain ``(op, bytes, seconds)`` samples.

    Least squares on relative error, so small and large messages count alike. When the
    data pin one of the two at zero (noise on tiny messages), it takes instead the bound
    the single most telling sample sets, which errs on the slow side.
    """
    coef = [(_coefficients(op, n, world), t) for op, n, t in samples]
    alpha, beta = _fit_two([(ca / t, cb / t) for (ca, cb), t in coef])
    if alpha <= 0:
        alpha = min(t / ca for (ca, _), t in coef)
    if beta <= 0:
        beta = min(t / cb for (_, cb), t in coef)
    return alpha, beta


# ----------------------------------------------------------------------------- measurements


def measure_matmul(dims: Sequence[int], dtype: torch.dtype, device: torch.device,
                   effort: Effort) -> list[tuple[float, float]]:
    """``(flops, seconds)`` of square matmuls of each size in ``dims``."""
    out = []
    for d in dims:
        x = torch.randn(d, d, device=device).to(dtype)
        w = torch.randn(d, d, device=device).to(dtype)
        out.append((2.0 * d ** 3, _seconds_per_call(lambda x=x, w=w: torch.mm(x, w), device,
                                                     effort)))
    return out


def measure_copy(nbytes: int, device: torch.device, effort: Effort) -> tuple[float, float]:
    """``(bytes moved, seconds)`` of one copy of ``nbytes`` (read once, written once)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2.0 * src.numel() * 4, _seconds_per_call(lambda: dst.copy_(src), device, effort)


def measure_copy_curve(sizes: Sequence[int], device: torch.device,
                       effort: Effort) -> list[tuple[float, float]]:
    """``(bytes moved, seconds)`` of one copy of each size: the bandwidth a memory-bound
    kernel reaches by how much it moves (small copies pay the launch, not the bytes)."""
    return [measure_copy(n, device, effort) for n in sizes]


def measure_launch_floor(device: torch.device, effort: Effort, calls: int = 2000) -> float:
    """Seconds per kernel of tiny kernels issued back to back (a one-element add): the
    least time one kernel takes however little it does."""
    x = torch.zeros(1, device=device)

    def many():
        for _ in range(calls):
            x.add_(1.0)

    return _seconds_per_call(many, device, effort) / calls


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """The full (unmasked) FLOPs of one attention forward + backward, as the cost model counts
    them: QK^T and PV, 2 x 2 b h s^2 d forward, the backward twice the forward."""
    return 3 * 4.0 * batch * heads * seq * seq * head_dim


def measure_attention(seqs: Sequence[int], heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device, effort: Effort,
                      tokens: int | None = None) -> list[tuple[int, float, float]]:
    """``(seq, flops, seconds)`` of causal scaled-dot-product attention forward + backward at
    each sequence length (PyTorch's fused kernel: flash on a GPU), ``tokens`` per call
    (batch = tokens // seq, at least 1)."""
    import torch.nn.functional as F

    out = []
    for seq in seqs:
        batch = max(1, (tokens or seq) // seq)
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

        def step(q=q, k=k, v=v, grad=grad):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        out.append((seq, attention_flops(batch, heads, seq, head_dim),
                    _seconds_per_call(step, device, effort)))
    return out


def fit_attention(rows: Sequence[tuple[int, float, float]], peak: float) -> tuple[float, float]:
    """``(attention_efficiency, attention_half_tokens)`` of the cost model's curve
    ``rate = peak x efficiency x S / (S + half)`` on the causal half of the FLOPs, from
    :func:`measure_attention`'s rows: a least-squares line of 1 / efficiency over 1 / S."""
    pts = [(1.0 / seq, (flops / 2) / seconds / peak) for seq, flops, seconds in rows]
    a, b = _fit_two([(e, x * e) for x, e in pts])  # 1/e = a + b/S, each row times e
    best = 1.0 / a if a > 0 else max(e for _, e in pts)
    return min(best, 1.0), (b * best if a > 0 else 0.0)


def _all_reduce(numel, world, rank, device):
    t = torch.zeros(numel, device=device)
    return lambda: dist.all_reduce(t)


def _all_gather(numel, world, rank, device):
    out, part = torch.zeros(numel, device=device), torch.zeros(numel // world, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return lambda: gather(out, part)


def _reduce_scatter(numel, world, rank, device):
    full, part = torch.zeros(numel, device=device), torch.zeros(numel // world, device=device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return lambda: scatter(part, full)


def _all_to_all(numel, world, rank, device):
    send, recv = torch.zeros(numel, device=device), torch.zeros(numel, device=device)
    return lambda: dist.all_to_all_single(recv, send)


def _broadcast(numel, world, rank, device):
    t = torch.zeros(numel, device=device)
    return lambda: dist.broadcast(t, src=0)


def _p2p(numel, world, rank, device):
    """Every rank sends to the next and receives from the previous, as pipeline stages do."""
    send, recv = torch.zeros(numel, device=device), torch.zeros(numel, device=device)

    def exchange():
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world),
               dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return exchange


# op -> (elements, world, rank, device) -> one call of the collective on float32 tensors
COLLECTIVES: dict[str, Callable] = {
    "all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all, "broadcast": _broadcast, "p2p": _p2p}


def measure_collectives(sizes: Sequence[int], device: torch.device, effort: Effort,
                        collectives: dict[str, Callable] = COLLECTIVES) -> dict[str, dict]:
    """Seconds of each collective at each message size (bytes, in comm's conventions).

    A collective the backend refuses (it raises on its first call, on every rank alike)
    is recorded as skipped, with the backend's reason, instead of failing the run.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, dict] = {}
    for op, make in collectives.items():
        record: dict = {"algorithm": FIT_ALGORITHM[op], "bytes": [], "seconds": []}
        for nbytes in sizes:
            numel = max(world, round(nbytes / 4 / world) * world)
            call = make(numel, world, rank, device)
            try:
                call()
            except (RuntimeError, NotImplementedError) as e:
                record = {"skipped": f"{dist.get_backend()} does not run {op}: {e}".splitlines()[0]}
                break
            record["bytes"].append(numel * 4)
            record["seconds"].append(_seconds_per_call(call, device, effort, together=True))
        out[op] = record
    return out


# ----------------------------------------------------------------------------- calibrate


def calibrate(base: str = "cpu", sizes: Sequence[int] | None = None, quick: bool = False,
              name: str | None = None) -> Hardware:
    """A profile of this machine: ``base`` with what was measured here put in.

    ``sizes`` are the collective message sizes in bytes (``quick`` picks tiny ones and
    short timings, for tests). Run it on every rank when ``torch.distributed`` is up.
    """
    hw = load_hardware(base)
    effort = QUICK if quick else FULL
    device, world = _device(), _world()
    compute, compute_extra = _calibrate_compute(hw, device, effort, world)
    if world > 1:
        links, links_extra = _calibrate_links(sizes or effort.message_bytes, device, effort, world)
    else:
        links, links_extra = {}, {"links": f"not measured (one rank): kept from '{base}'"}
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    extra = {"calibration": {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                             "device": label, "world": world,
                             "backend": dist.get_backend() if world > 1 else None,
                             "threads": torch.get_num_threads(), "quick": quick, "base": base},
             **compute_extra, **links_extra}
    return replace(hw, name=name or f"{base}-calibrated",
                   source=f"measured by `autopar calibrate` on {label} ({world} "
                          f"rank{'s' if world > 1 else ''}, torch {torch.__version__}); "
                          f"other facts from '{base}'",
                   extra=extra, **compute, **links)


def _calibrate_compute(hw: Hardware, device: torch.device, effort: Effort,
                       world: int) -> tuple[dict, dict]:
    """Profile fields for matmul and memory, and the raw measurements behind them."""
    dims = effort.matmul_dims[device.type]
    curve_dtype = BF16 if device.type == "cuda" else FP32
    curve = measure_matmul(dims, DTYPES[curve_dtype], device, effort)
    flops, seconds = [f for f, _ in curve], [s for _, s in curve]
    others, skipped = {}, {}
    for dt in DTYPES:
        if dt in hw.peak_flops and dt != curve_dtype:
            try:
                others[dt] = measure_matmul(dims[-1:], DTYPES[dt], device, effort)[0][1]
            except (RuntimeError, NotImplementedError) as e:  # no kernel for it here
                skipped[dt] = str(e).splitlines()[0]
    moved, copy_s = measure_copy(effort.copy_bytes, device, effort)
    if world > 1:  # every rank timed its own: take the mean, so all ranks agree
        mean = _mean_over_ranks(seconds + list(others.values()) + [copy_s], device, world)
        seconds, copy_s = mean[:len(seconds)], mean[-1]
        others = dict(zip(others, mean[len(seconds):-1]))

    peak, efficiency, half = fit_gemm(flops, seconds)
    at_largest = efficiency * flops[-1] / (flops[-1] + half)
    peak_flops = {**hw.peak_flops, curve_dtype: peak}
    for dt, s in others.items():  # the same curve, through this dtype's largest matmul
        peak_flops[dt] = flops[-1] / s / at_largest
    measured = {curve_dtype, *others}
    if device.type == "cpu" and TF32 in peak_flops:  # a CPU runs TF32 requests in fp32
        peak_flops[TF32] = peak_flops[FP32]
        measured.add(TF32)
    fields = dict(peak_flops=peak_flops, gemm_efficiency=efficiency, gemm_half_flops=half,
                  memory_bandwidth=moved / copy_s, memory_efficiency=1.0)
    # torch.optim's default here: foreach kernels on CUDA, a loop over the tensors on the CPU
    fields["optimizer_implementation"] = "foreach" if device.type == "cuda" else "for_loop"
    seqs, heads, head_dim, tokens = (QUICK_ATTENTION if effort is QUICK else
                                     ATTENTION)[device.type]
    attention = measure_attention(seqs, heads, head_dim, DTYPES[curve_dtype], device, effort,
                                  tokens)
    floor = measure_launch_floor(device, effort, calls=200 if effort is QUICK else 2000)
    curve_bytes = measure_copy_curve((QUICK_COPY_CURVE if effort is QUICK else
                                      COPY_CURVE)[device.type], device, effort)
    if world > 1:  # as above: the mean over the ranks, so all agree
        mean = _mean_over_ranks([t for *_, t in attention] + [floor] +
                                [t for _, t in curve_bytes], device, world)
        attention = [(q, f, t) for (q, f, _), t in zip(attention, mean)]
        floor = mean[len(attention)]
        curve_bytes = [(b, t) for (b, _), t in zip(curve_bytes, mean[len(attention) + 1:])]
    att_eff, att_half = fit_attention(attention, peak_flops[curve_dtype])
    if device.type == "cuda":
        fields["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        # a GPU's fused attention kernel and its launch floor are what the profile prices;
        # a CPU's attention stays priced as the matmuls it runs (extra keeps the figures)
        fields.update(attention_efficiency=att_eff, attention_half_tokens=att_half,
                      kernel_floor_s=floor)
    else:
        # the host of a CPU rank is its own memory: an offload copy is a memory copy
        # (``moved`` counts the read and the write of each byte copied)
        fields["host_bandwidth"] = moved / copy_s / 2
        fields["compute_share"] = compute_share(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    extra = {"matmul": {"dtype": curve_dtype, "dims": list(dims), "flops": flops,
                        "seconds": seconds},
             "matmul_other_dtypes": {dt: {"dim": dims[-1], "seconds": s}
                                     for dt, s in others.items()},
             "copy": {"bytes_moved": moved, "seconds": copy_s},
             "copy_curve": [{"bytes_moved": b, "seconds": t} for b, t in curve_bytes],
             "attention": {"dtype": curve_dtype, "heads": heads, "head_dim": head_dim,
                           "causal": True, "fit": {"efficiency": att_eff, "half_tokens": att_half},
                           "rows": [{"seq": q, "flops": f, "seconds": t}
                                    for q, f, t in attention]},
             "launch_floor_s": floor,
             "peak_flops_kept_from_base": sorted(set(peak_flops) - measured)}
    if skipped:
        extra["matmul_skipped"] = skipped
    return fields, extra


def compute_share(ranks: int, threads: int | None = None, cores: int | None = None) -> float:
    """The share of its own full speed a CPU rank computes at while all ``ranks`` of this
    machine compute (each with ``threads`` threads) on ``cores`` cores: 1 when the cores
    suffice, else cores / (ranks x threads). Defaults: this process's threads and the
    cores it may run on."""
    threads = threads or torch.get_num_threads()
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
    return min(1.0, cores / (max(1, ranks) * max(1, threads)))


def _calibrate_links(sizes: Sequence[int], device: torch.device, effort: Effort,
                     world: int) -> tuple[dict, dict]:
    """Profile fields for the links, fitted over every collective, and the measurements."""
    measured = measure_collectives(sizes, device, effort)
    samples = []
    for op, record in measured.items():
        if "skipped" not in record:
            mine = [(op, n, t) for n, t in zip(record["bytes"], record["seconds"])]
            record["alpha"], record["beta"] = fit_alpha_beta(mine, world)
            samples += mine
    alpha, beta = fit_alpha_beta(samples, world)
    fields = dict(intra_node_latency=alpha, intra_node_bandwidth=1.0 / beta,
                  inter_node_latency=alpha, inter_node_bandwidth=1.0 / beta,
                  collectives={op: {"algorithm": r["algorithm"], "alpha": r["alpha"],
                                    "beta": r["beta"]}
                               for op, r in measured.items() if "skipped" not in r})
    return fields, {"collectives": measured,
                    "links": "alpha and beta fitted over every collective measured; inter-node "
                             "copies intra-node, since the ranks measured share one node"}


def summary(hw: Hardware) -> str:
    """One line of what a profile says, for the command line."""
    dtype = hw.extra["matmul"]["dtype"]
    return (f"{hw.name}: {dtype} {hw.flops(dtype) / 1e9:.3g} GFLOP/s (efficiency "
            f"{hw.gemm_efficiency:.2f}, half at {hw.gemm_half_flops / 1e6:.3g} MFLOP), memory "
            f"{hw.memory_bandwidth / 1e9:.3g} GB/s, links {hw.intra_node_latency * 1e6:.3g} us + "
            f"{hw.intra_node_bandwidth / 1e9:.3g} GB/s")


# ----------------------------------------------------------------------------- command line


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``autopar calibrate`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "calibrate", help="measure this machine and write a hardware profile",
        description="Measure matmul throughput and memory bandwidth, and under torchrun or "
                    "--world N the collectives, and write a profile that --device accepts.")
    p.add_argument("-o", "--output", required=True, help="the profile JSON file to write")
    p.add_argument("--base", default="cpu",
                   help="built-in profile whose unmeasured facts are kept (default cpu)")
    p.add_argument("--name", default=None, help="the profile's name (default BASE-calibrated)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: seconds, not minutes")
    p.add_argument("--world", type=int, default=1,
                   help="spawn N local processes to measure collectives too (not under torchrun)")
    return p


def run(args) -> int:
    """Run ``autopar calibrate``: measure, write ``args.output`` from rank 0, print a summary."""
    load_hardware(args.base)  # an unknown base fails here, before any process starts
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if args.world < 1:
        raise WorldError(f"--world must be at least 1, not {args.world}.")
    if args.world > 1 and launched > 1:
        raise WorldError(f"--world {args.world} spawns its own processes, but this one is "
                         f"already rank {os.environ.get('RANK')} of {launched}; drop --world "
                         "under torchrun.")
    options = {"base": args.base, "quick": args.quick, "name": args.name, "output": args.output}
    if args.world > 1:
        _spawn(args.world, options)
    elif launched > 1 and _run_launched(options) != 0:
        return 0  # rank 0 reports
    elif launched == 1:
        _calibrate_and_write(options, write=True)
    with open(args.output) as f:
        print(f"wrote {args.output}: {summary(Hardware.from_json(json.load(f)))}")
    return 0


def _calibrate_and_write(options: dict, write: bool) -> None:
    hw = calibrate(options["base"], quick=options["quick"], name=options["name"])
    if write:
        hw.save(options["output"])


def _backend(local_ranks: int) -> str:
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
    return "nccl" if enough_gpus else "gloo"


def _run_launched(options: dict) -> int:
    """Under torchrun: join its process group, calibrate with every rank; this rank."""
    backend = _backend(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    try:
        _calibrate_and_write(options, write=rank == 0)
    finally:
        dist.destroy_process_group()
    return rank


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, options: dict) -> None:
    """Start `world` local processes that rendezvous on a free localhost port."""
    try:
        mp.spawn(_spawned, args=(world, _free_port(), options), nprocs=world, join=True)
    except ProcessException as e:
        last = str(e).strip().splitlines()[-1]
        raise WorldError(f"calibration failed in a spawned process ({last}); run with "
                         "--world 1 to see compute alone, or under torchrun.") from e


def _spawned(rank: int, world: int, port: int, options: dict) -> None:
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.isdir("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo on loopback, as the port is
    backend = _backend(world)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    try:
        _calibrate_and_write(options, write=rank == 0)
    finally:
        dist.destroy_process_group()
