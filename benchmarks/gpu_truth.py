"""Truth on one GPU: the cost model and the runtime measured on the card at hand, in one call.

    python benchmarks/gpu_truth.py [--device cuda|cpu] [--quick] [--budget-s 540]
                                   [--sections calibrate,predict,overhead,ranks] [--out DIR]

Four sections, each in a process of its own (one that fails or runs out of time costs
only itself), in this order:

    calibrate  `autopar calibrate` on the device: GEMM curve, attention by sequence length,
               HBM bandwidth by bytes moved, launch floor; plus the per-rank GEMM shapes of
               Llama-3 8B at tp 1, 2, 4, 8, each timed beside what the built-in profile and
               the calibrated one predict. Writes the calibrated profile.
    predict    three models with the shapes of real ones (Llama-3 8B blocks, GPT-2 XL,
               an 8-expert MoE), bf16 on fp32 masters, world 1: the plan's step time,
               per-layer times and peak memory beside CUDA-event times and
               max_memory_allocated, priced with the built-in and the calibrated profile.
    overhead   one model's step through `parallelize(..., world 1)` beside the same model
               in plain PyTorch eager (autocast bf16) and under torch.compile.
    ranks      two processes on the one device (gloo; NCCL refuses two ranks per GPU):
               tensor 2, ZeRO-3 over dp 2 and pipeline 2, each equal to one device in bf16;
               then ZeRO-3 compiled (`compile=True`) beside ZeRO-3 eager, their steps taking
               turns: the step time's ratio and the losses of the two, which must be equal.

One table last; JSON in DIR (default benchmarks/results/gpu_truth, or $OUT/gpu_truth when
the device tool's OUT is set). Before it starts it refuses, in one sentence, when the
sections' estimated time does not fit in --budget-s. Without a GPU (`--device cuda` on a
machine with none) it says so and exits 0; `--device cpu --quick` runs every section on
tiny models on the CPU (tests/test_gpu_truth.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Seconds each section is expected to take on an H100/H200 (full) and on the CPU (quick):
# the budget check adds them up before anything starts.
ESTIMATE_S = {"calibrate": (70, 60), "predict": (200, 60), "overhead": (110, 45),
              "ranks": (130, 60)}
SECTIONS = tuple(ESTIMATE_S)

# name -> (zoo spec, batch); shapes of real models' blocks, few of them
MODELS = {
    "llama3-8b x2": ("llama:layers=2,hidden=4096,heads=32,kv_heads=8,ffn=14336,"
                     "vocab=128256,seq=4096", 2),
    "gpt2-xl x4": ("gpt:layers=4,hidden=1600,heads=25,vocab=50257,seq=2048", 4),
    "moe 8x2048 x2": ("moe:layers=2,hidden=2048,heads=16,kv_heads=8,ffn=5632,experts=8,"
                      "top_k=2,vocab=32000,seq=4096", 2),
}
QUICK_MODELS = {
    "llama x2": ("llama:layers=2,hidden=64,heads=4,kv_heads=2,ffn=128,vocab=256,seq=32", 2),
    "gpt x2": ("gpt:layers=2,hidden=64,heads=4,vocab=256,seq=32", 2),
    "moe x2": ("moe:layers=2,hidden=64,heads=4,kv_heads=2,ffn=32,experts=4,top_k=2,"
               "vocab=256,seq=32", 2),
}
OVERHEAD_MODEL = "gpt2-xl x4"
RANK_MODEL = ("llama:layers=2,hidden=512,heads=8,kv_heads=8,ffn=1376,vocab=4096,seq=256", 4)
QUICK_RANK_MODEL = ("llama:layers=2,hidden=64,heads=4,kv_heads=4,ffn=128,vocab=256,seq=16", 4)
# Llama-3 8B's GEMMs as one rank of tp = 1, 2, 4, 8 runs them (M tokens, K, N)
LLAMA8B = dict(hidden=4096, q=4096, kv=1024, ffn=14336, vocab=128256)
STEP_GOAL, MEMORY_GOAL, OVERHEAD_GOAL, LOSS_TOLERANCE = 0.10, 0.05, 0.03, 0.02
COMPILED_ZERO3_GOAL = 0.97  # compiled ZeRO-3's step at most this much of eager ZeRO-3's (#33)
ZERO3 = {"data": 2, "zero": {"stage": 3}}


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _adamw():
    return functools.partial(torch.optim.AdamW, lr=1e-4)


def _timed(step, device, warmup: int, steps: int) -> float:
    """Median seconds of `steps` calls of step() after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _builtin(device) -> str:
    from autopar.world import local_device

    return local_device() if device.type == "cuda" else "cpu"


def _profile_path(out: str) -> str:
    return os.path.join(out, "calibrated_profile.json")


def _data(spec: str, batch: int, device, seed: int = 0):
    from autopar.models import build
    from autopar.models.zoo import config_of

    gen = torch.Generator().manual_seed(seed)
    _, (x,) = build(spec, batch=batch)  # meta: shapes only
    vocab = config_of(spec).vocab_size
    x = torch.randint(0, vocab, x.shape, generator=gen)
    y = torch.randint(0, vocab, x.shape, generator=gen)
    return x.to(device), y.to(device)


def _model(spec: str, batch: int, device, seed: int = 0):
    """The zoo model on `device`, initialised there (a GPU inits billions of weights in
    milliseconds; the CPU of the GPU's host would take seconds)."""
    from autopar.models import build

    torch.manual_seed(seed)
    model, _ = build(spec, batch=batch, device=device)
    return model


# ------------------------------------------------------------------------- calibrate
def gemm_shapes(tokens: int, tp: int, d=LLAMA8B) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of each linear of a Llama-3 8B block (and its head) on one rank of tp."""
    return {"qkv": (tokens, d["hidden"], (d["q"] + 2 * d["kv"]) // tp),
            "o": (tokens, d["q"] // tp, d["hidden"]),
            "gate_up": (tokens, d["hidden"], 2 * d["ffn"] // tp),
            "down": (tokens, d["ffn"] // tp, d["hidden"]),
            "head": (tokens, d["hidden"], d["vocab"] // tp)}


def section_calibrate(args, device) -> dict:
    from autopar.cost.calibrate import FULL, QUICK, _seconds_per_call, calibrate
    from autopar.cost.hardware import load_hardware
    from autopar.cost.model import gemm_time

    base = _builtin(device)
    builtin = load_hardware(base)
    started = time.perf_counter()
    cal = calibrate(base=base, quick=args.quick, name=f"{base}-measured")
    cal.save(_profile_path(args.out))
    effort = QUICK if args.quick else FULL
    tokens = 256 if args.quick else 8192
    dims = dict(hidden=256, q=256, kv=64, ffn=512, vocab=1024) if args.quick else LLAMA8B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = []
    for tp in (1, 2, 4, 8):
        for name, (m, k, n) in gemm_shapes(tokens, tp, dims).items():
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            sec = _seconds_per_call(lambda a=a, b=b: torch.mm(a, b), device, effort)
            flops = 2.0 * m * k * n
            dt = "bf16" if dtype == torch.bfloat16 else "fp32"
            shapes.append({"tp": tp, "gemm": name, "shape": [m, k, n], "measured_s": sec,
                           "tflops": flops / sec / 1e12,
                           "builtin_s": gemm_time(flops, builtin, dt, (m, k, n)),
                           "calibrated_s": gemm_time(flops, cal, dt, (m, k, n))})
            del a, b
    dt = "bf16" if device.type == "cuda" else "fp32"
    ex = cal.extra
    facts = [
        ("peak matmul rate (TFLOP/s)", builtin.flops(dt) / 1e12, cal.flops(dt) / 1e12),
        ("gemm_efficiency", builtin.gemm_efficiency, cal.gemm_efficiency),
        ("gemm_half_flops (GFLOP)", builtin.gemm_half_flops / 1e9, cal.gemm_half_flops / 1e9),
        ("memory_bandwidth (TB/s, x efficiency)",
         builtin.memory_bandwidth * builtin.memory_efficiency / 1e12,
         cal.memory_bandwidth * cal.memory_efficiency / 1e12),
        ("attention_efficiency", builtin.attention_efficiency,
         ex["attention"]["fit"]["efficiency"]),
        ("attention_half_tokens", builtin.attention_half_tokens,
         ex["attention"]["fit"]["half_tokens"]),
        ("kernel_floor_s (us)", builtin.kernel_floor_s * 1e6, ex["launch_floor_s"] * 1e6),
    ]
    return {"builtin": base, "calibrated_profile": cal.to_json(),
            "facts": [{"what": w, "builtin": b, "measured": m} for w, b, m in facts],
            "gemm_shapes": shapes, "seconds": time.perf_counter() - started}


# ------------------------------------------------------------------------- predict
def _plan(spec, batch, device, world_device, constraints=None):
    import autopar
    from autopar.models import build
    from autopar.world import World

    meta, (x,) = build(spec, batch=batch)
    return autopar.plan(meta, (x,), World(devices=1, per_node=1, device=world_device),
                        global_batch=batch, loss_fn=lm_loss, example_target=x,
                        dtype="bf16", executable=True, top=1,
                        constraints=dict(dp=1, tp=1, pp=1, zero=0, recompute="none",
                                         sp="none", offload=False, **(constraints or {})))


def _engine(spec, batch, device, plan):
    import autopar

    model = _model(spec, batch, device)
    x, _ = _data(spec, batch, device)
    return autopar.parallelize(model, 1, example_inputs=(x[:1],), loss_fn=lm_loss,
                               optimizer=_adamw(), plan=plan, precision="bf16")


def _layer_rows(report: dict) -> list[dict]:
    rows = []
    for layer in report["layers"]:
        p, m = layer.get("predicted") or {}, layer.get("measured") or {}
        rows.append({"layer": layer["name"],
                     "predicted_s": (p.get("forward_s", 0) or 0) + (p.get("backward_s", 0) or 0),
                     "measured_s": (m.get("forward_s", 0) or 0) + (m.get("backward_s", 0) or 0),
                     "predicted_activation_bytes": p.get("activation_bytes"),
                     "measured_activation_bytes": m.get("activation_bytes")})
    return rows


def section_predict(args, device) -> dict:
    from autopar.world import World

    models = QUICK_MODELS if args.quick else MODELS
    cal_path = _profile_path(args.out)
    calibrated = cal_path if os.path.exists(cal_path) else None
    out = []
    for name, (spec, batch) in models.items():
        row = {"model": name, "spec": spec, "batch": batch}
        try:
            t0 = time.perf_counter()
            plan = _plan(spec, batch, device, _builtin(device))
            row["plan_s"] = time.perf_counter() - t0
            _peak_reset(device)
            engine = _engine(spec, batch, device, plan)
            x, y = _data(spec, batch, device)
            steps = 3 if args.quick else 6
            row["measured_step_s"] = _timed(functools.partial(engine.train_step, x, y), device,
                                            2, steps)
            row["measured_peak_bytes"] = _peak(device)
            pred = plan.predicted
            row["predicted_step_s"] = pred["step_time_s"]
            row["predicted_memory_bytes"] = pred["memory_per_device_bytes"]
            row["memory_breakdown_bytes"] = pred["memory_breakdown_bytes"]
            report = engine.explain(format="json",
                                    world=World(devices=1, per_node=1, device=_builtin(device)))
            row["layers"] = _layer_rows(report)
            row["explain_step"] = report["step"]
            if calibrated:
                cal = engine.explain(format="json",
                                     world=World(devices=1, per_node=1, device=calibrated))
                row["calibrated_step_s"] = cal["step"]["predicted_s"]
                row["layers_calibrated"] = _layer_rows(cal)
            engine = None  # its memory goes back before the next model
        except Exception as e:  # noqa: BLE001 - one model's failure is a row, not the end
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:400]
            row["traceback"] = traceback.format_exc()[-3000:]
        _peak_reset(device)
        out.append(row)
    return {"models": out}


# ------------------------------------------------------------------------- overhead
def section_overhead(args, device) -> dict:
    models = QUICK_MODELS if args.quick else MODELS
    name = "gpt x2" if args.quick else OVERHEAD_MODEL
    spec, batch = models[name]
    x, y = _data(spec, batch, device)
    steps, warm = (3, 1) if args.quick else (10, 3)
    rows = {}

    def eager_step(model, opt):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    model = _model(spec, batch, device)
    rows["eager"] = _timed(functools.partial(eager_step, model, _adamw()(model.parameters())),
                           device, warm, steps)
    model = _model(spec, batch, device)
    step = functools.partial(eager_step, torch.compile(model, backend=args.compile_backend),
                             _adamw()(model.parameters()))
    t0 = time.perf_counter()
    step()
    rows["compile_first_step_s"] = time.perf_counter() - t0
    rows["torch.compile"] = _timed(step, device, warm, steps)
    model = step = None  # their memory goes back before autopar's engine is built
    plan = _plan(spec, batch, device, _builtin(device))
    engine = _engine(spec, batch, device, plan)
    step = functools.partial(engine.train_step, x, y)
    rows["autopar"] = _timed(step, device, warm, steps)
    engine.recorder.enabled = False
    rows["autopar (recorder off)"] = _timed(step, device, warm, steps)
    return {"model": name, "spec": spec, "batch": batch, "step_s": rows,
            "overhead": rows["autopar"] / rows["eager"] - 1,
            "overhead_recorder_off": rows["autopar (recorder off)"] / rows["eager"] - 1}


# ------------------------------------------------------------------------- ranks
def rank_plans() -> dict[str, dict]:
    return {"tensor 2": {"tensor": {"size": 2, "mode": "1d"}},
            "zero3 dp 2": ZERO3,
            "pipeline 2": {"pipeline": {"size": 2, "schedule": "1f1b", "microbatches": 2}}}


def _rank_worker(rank, world, port, args, path):
    import copy

    import torch.distributed as dist

    import autopar

    warnings.filterwarnings("ignore")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    device = torch.device(args.device, 0)  # every rank on the one GPU
    if device.type == "cpu":
        torch.set_num_threads(1)  # as torchrun starts CPU ranks: two threads each only spin
    spec, batch = QUICK_RANK_MODEL if args.quick else RANK_MODEL
    model = _model(spec, batch, device)
    x, y = _data(spec, batch, device)
    single = copy.deepcopy(model)
    opt = _adamw()(single.parameters())
    reference = []
    for _ in range(3):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = lm_loss(single(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        reference.append(float(loss))
    rows, eager_zero3 = {}, None
    for name, plan in rank_plans().items():
        try:
            engine = autopar.parallelize(copy.deepcopy(model), world, example_inputs=(x[:2],),
                                         loss_fn=lm_loss, optimizer=_adamw(), plan=plan,
                                         precision="bf16")
            losses = [engine.train_step(x, y) for _ in range(3)]
            on = {p.device.type for p in engine.parameters()}
            rows[name] = {"losses": losses, "reference": reference, "devices": sorted(on),
                          "error_rel": max(abs(a - b) / abs(b) for a, b in zip(losses,
                                                                               reference)),
                          "comm_bytes": sum(r.bytes for r in engine.comm_log)}
            if plan is ZERO3:
                eager_zero3 = engine  # the eager side of _compiled_zero3
            engine = None
        except Exception as e:  # noqa: BLE001 - the sentence is the result
            rows[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:400],
                          "traceback": traceback.format_exc()[-3000:]}
        dist.barrier()
    try:
        compiled = _compiled_zero3(eager_zero3, model, world, (x, y), args, device)
    except Exception as e:  # noqa: BLE001 - the sentence is the result
        compiled = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:400],
                    "traceback": traceback.format_exc()[-3000:]}
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"spec": spec, "batch": batch, "plans": rows,
                       "zero3_compiled": compiled}, f, indent=1)
    dist.destroy_process_group()


def _compiled_zero3(eager, model, world, batch, args, device, steps: int = 6) -> dict:
    """ZeRO-3 compiled beside ZeRO-3 eager (`eager`, the engine the plans above trained 3
    steps): the compiled engine's first 3 steps, whose losses must equal eager's first 3,
    then `steps` rounds of one step of each, the order alternating; the median step times
    and the median of the rounds' ratios."""
    import copy

    import torch.distributed as dist

    import autopar

    x, y = batch
    engine = autopar.parallelize(copy.deepcopy(model), world, example_inputs=(x[:2],),
                                 loss_fn=lm_loss, optimizer=_adamw(),
                                 plan=copy.deepcopy(ZERO3),
                                 precision="bf16", compile=True)
    # the CPU test passes --compile-backend eager: the regions' code path, not inductor's C++
    engine.regions.backend = args.compile_backend
    start = time.perf_counter()
    losses = [engine.train_step(x, y)]
    first = time.perf_counter() - start
    losses += [engine.train_step(x, y) for _ in range(2)]
    engines = {"eager": eager, "compiled": engine}
    times = {name: [] for name in engines}
    for step in range(steps):
        for name in engines if step % 2 == 0 else list(engines)[::-1]:
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            engines[name].train_step(x, y)
            _sync(device)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    return {"backend": args.compile_backend, "first_step_s": first, "losses": losses,
            "step_s": {name: statistics.median(t) for name, t in times.items()},
            "ratio": statistics.median(c / e for c, e in zip(times["compiled"],
                                                             times["eager"])),
            "regions": engine.regions.regions}


def section_ranks(args, device) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.path.join(args.out, "ranks_raw.json")
    mp.spawn(_rank_worker, args=(2, port, args, path), nprocs=2)
    with open(path) as f:
        return json.load(f)


# ------------------------------------------------------------------------- driver
def run_section(name: str, args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    started = time.perf_counter()
    result = {"section": name, "device": args.device,
              "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
              "torch": torch.__version__}
    try:
        result.update(globals()[f"section_{name}"](args, device))
    except Exception as e:  # noqa: BLE001 - recorded for the table
        result["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:400]
        result["traceback"] = traceback.format_exc()[-4000:]
    result["wall_s"] = time.perf_counter() - started
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


def _ratio(a, b):
    return a / b if a is not None and b else None


def _fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def summarize(results: dict) -> list[dict]:
    """The last table's rows: what was checked, measured, predicted, the ratio, the goal."""
    rows = []
    cal = results.get("calibrate", {})
    for fact in cal.get("facts", []):
        rows.append({"check": "profile", "what": fact["what"], "measured": fact["measured"],
                     "predicted": fact["builtin"],
                     "ratio": _ratio(fact["builtin"], fact["measured"]), "goal": None})
    for m in results.get("predict", {}).get("models", []):
        if "error" in m:
            rows.append({"check": "predict", "what": f"{m['model']}: {m['error']}",
                         "measured": None, "predicted": None, "ratio": None, "goal": None,
                         "failed": True})
            continue
        r = _ratio(m["predicted_step_s"], m["measured_step_s"])
        rows.append({"check": "step", "what": f"{m['model']} built-in profile",
                     "measured": m["measured_step_s"], "predicted": m["predicted_step_s"],
                     "ratio": r, "goal": STEP_GOAL})
        if "calibrated_step_s" in m:
            rows.append({"check": "step", "what": f"{m['model']} calibrated profile",
                         "measured": m["measured_step_s"], "predicted": m["calibrated_step_s"],
                         "ratio": _ratio(m["calibrated_step_s"], m["measured_step_s"]),
                         "goal": STEP_GOAL})
        if m.get("measured_peak_bytes"):
            rows.append({"check": "memory", "what": f"{m['model']} peak",
                         "measured": m["measured_peak_bytes"] / 2 ** 30,
                         "predicted": m["predicted_memory_bytes"] / 2 ** 30,
                         "ratio": _ratio(m["predicted_memory_bytes"], m["measured_peak_bytes"]),
                         "goal": MEMORY_GOAL})
    ov = results.get("overhead", {})
    if "step_s" in ov:
        rows.append({"check": "overhead", "what": f"autopar / eager ({ov['model']})",
                     "measured": ov["step_s"]["autopar"], "predicted": ov["step_s"]["eager"],
                     "ratio": ov["step_s"]["autopar"] / ov["step_s"]["eager"],
                     "goal": OVERHEAD_GOAL})
        rows.append({"check": "overhead", "what": "autopar recorder off / eager",
                     "measured": ov["step_s"]["autopar (recorder off)"],
                     "predicted": ov["step_s"]["eager"],
                     "ratio": ov["step_s"]["autopar (recorder off)"] / ov["step_s"]["eager"],
                     "goal": OVERHEAD_GOAL})
        rows.append({"check": "overhead", "what": "torch.compile / eager",
                     "measured": ov["step_s"]["torch.compile"],
                     "predicted": ov["step_s"]["eager"],
                     "ratio": ov["step_s"]["torch.compile"] / ov["step_s"]["eager"],
                     "goal": None})
    for name, r in results.get("ranks", {}).get("plans", {}).items():
        if "error" in r:
            rows.append({"check": "ranks", "what": f"{name}: {r['error']}", "measured": None,
                         "predicted": None, "ratio": None, "goal": None, "failed": True})
        else:
            rows.append({"check": "ranks", "what": f"{name} on {'/'.join(r['devices'])} vs one "
                         "device (loss)", "measured": r["losses"][-1],
                         "predicted": r["reference"][-1], "ratio": 1 + r["error_rel"],
                         "goal": LOSS_TOLERANCE})
    z3 = results.get("ranks", {}).get("zero3_compiled")
    eager_z3 = results.get("ranks", {}).get("plans", {}).get("zero3 dp 2", {})

    if z3 and "error" in z3:
        rows.append({"check": "ranks", "what": f"zero3 compiled: {z3['error']}",
                     "measured": None, "predicted": None, "ratio": None, "goal": None,
                     "failed": True})
    elif z3:
        diff = max(abs(a - b) / abs(b) for a, b in zip(z3["losses"], eager_z3.get(
            "losses", [float("nan")])))
        rows.append({"check": "ranks", "what": "zero3 compiled / eager (step s; loss diff "
                     f"{diff:.1e})", "measured": z3["step_s"]["compiled"],
                     "predicted": z3["step_s"]["eager"], "ratio": z3["ratio"],
                     "goal": COMPILED_ZERO3_GOAL,
                     "goal_text": f"at most {COMPILED_ZERO3_GOAL:.2f}x"})
    for name, res in results.items():
        if "error" in res:
            rows.append({"check": name, "what": f"section failed: {res['error']}",
                         "measured": None, "predicted": None, "ratio": None, "goal": None,
                         "failed": True})
    return rows


def print_details(results: dict) -> None:
    cal = results.get("calibrate", {})
    if cal.get("gemm_shapes"):
        print("\nLlama-3 8B GEMMs per rank (measured vs the cost model, built-in / calibrated)")
        print(f"{'tp':>3} {'gemm':<8} {'M x K x N':<22} {'TFLOP/s':>8} {'meas ms':>8} "
              f"{'built-in':>9} {'calib':>7}")
        for g in cal["gemm_shapes"]:
            print(f"{g['tp']:>3} {g['gemm']:<8} {'x'.join(map(str, g['shape'])):<22} "
                  f"{g['tflops']:>8.1f} {g['measured_s'] * 1e3:>8.3f} "
                  f"{g['builtin_s'] / g['measured_s']:>8.2f}x {g['calibrated_s'] / g['measured_s']:>6.2f}x")
    for m in results.get("predict", {}).get("models", []):
        if "layers" not in m:
            continue
        print(f"\n{m['model']}: per layer, fwd+bwd ms (predicted built-in / measured)")
        for r in m["layers"]:
            print(f"  {r['layer']:<28} {r['predicted_s'] * 1e3:>9.3f} {r['measured_s'] * 1e3:>9.3f}")


def print_table(rows: list[dict], header: str) -> None:
    print(f"\n{header}")
    print(f"{'check':<9} {'what':<52} {'measured':>10} {'predicted':>10} {'pred/meas':>9}  goal")
    for r in rows:
        goal = "" if r["goal"] is None else f"within {r['goal']:.0%}"
        if r["check"] == "overhead" and r["goal"] is not None:
            goal = f"at most +{r['goal']:.0%}"
        goal = r.get("goal_text", goal)
        print(f"{r['check']:<9} {r['what'][:52]:<52} {_fmt(r['measured'], '.4g'):>10} "
              f"{_fmt(r['predicted'], '.4g'):>10} {_fmt(r['ratio']):>9}  {goal}")


def default_out() -> str:
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], "gpu_truth")
    return os.path.join(ROOT, "benchmarks", "results", "gpu_truth")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny models (tests, CPU)")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds this run may take; refused when the estimate is more")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--out", default=None, help="results folder")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend for the overhead section (the CPU test "
                             "passes eager: the code path, not inductor's minutes of C++)")
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child's
    args = parser.parse_args(argv)
    args.out = args.out or default_out()
    os.makedirs(args.out, exist_ok=True)
    if args.section:
        return run_section(args.section, args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_truth: no GPU on this machine, nothing measured (run it where "
              "torch.cuda.is_available(), or pass --device cpu --quick).")
        return 0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"gpu_truth: unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}.",
              file=sys.stderr)
        return 2
    which = 1 if args.quick else 0
    need = sum(ESTIMATE_S[s][which] for s in sections)
    if need > args.budget_s:
        print(f"gpu_truth: the sections {', '.join(sections)} need about {need:.0f} s but "
              f"--budget-s is {args.budget_s:.0f} s; pass fewer --sections or a larger "
              "budget.", file=sys.stderr)
        return 2
    started = time.perf_counter()
    results = {}
    for name in sections:
        left = args.budget_s - (time.perf_counter() - started)
        share = max(30.0, left - sum(ESTIMATE_S[s][which] for s in
                                     sections[sections.index(name) + 1:]))
        cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--device",
               args.device, "--out", args.out, "--compile-backend", args.compile_backend] + \
            (["--quick"] if args.quick else [])
        print(f"[gpu_truth] {name} (at most {share:.0f} s) ...", flush=True)
        try:
            proc = subprocess.run(cmd, cwd=ROOT, timeout=share, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": ROOT})
            if proc.returncode != 0:
                results[name] = {"error": f"exit {proc.returncode}: "
                                 + (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
                print(proc.stderr[-3000:], file=sys.stderr)
        except subprocess.TimeoutExpired:
            results[name] = {"error": f"ran past its {share:.0f} s"}
        path = os.path.join(args.out, f"{name}.json")
        if name not in results and os.path.exists(path):
            with open(path) as f:
                results[name] = json.load(f)
            if "traceback" in results[name]:
                print(results[name]["traceback"], file=sys.stderr)
        print(f"[gpu_truth] {name} done in {time.perf_counter() - started:.0f} s", flush=True)
    rows = summarize(results)
    gpu = next((r.get("gpu") for r in results.values() if r.get("gpu")), None)
    summary = {"device": args.device, "gpu": gpu, "torch": torch.__version__,
               "quick": args.quick, "wall_s": time.perf_counter() - started, "rows": rows,
               "sections": results}
    with open(os.path.join(args.out, "gpu_truth.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print_details(results)
    print_table(rows, f"gpu_truth on {gpu or args.device} (torch {torch.__version__}), "
                      f"{summary['wall_s']:.0f} s")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
