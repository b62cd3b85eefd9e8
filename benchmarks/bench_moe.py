"""Expert parallelism at world 4 on this machine: ep 4 against the same MoE with every expert
replicated (data parallel) and against tensor-parallel experts.

    python benchmarks/bench_moe.py [--steps 6] [--tokens 2048] [--skip-measured]

(a) Predicted. The planner prices the zoo spec `SPEC` (global batch `BATCH` of `SEQ` tokens)
on 4 devices of the `cpu` profile with the mesh fixed three ways: dp 4 with ep 4 (one rank
per two experts), dp 4 with every expert on every rank, and tp 4, where each expert's FFN
width is split over the 4 tensor ranks (autopar.sharding.rules.experts; the router whole).
Columns: step time, memory per rank, expert weights per rank, tokens per expert per
micro-batch (balanced, and on the busiest rank times the routing imbalance the planner
measures on its router at initialisation, `autopar.cost.experts`) and the all-to-all bytes
on ep per step.

(a') Predicted, the search's own choice for dense-first MoE models (no part of the plan
fixed): `DENSE_SPEC` (its first block dense) on the same 4 cpu devices, and the zoo's
deepseek-v3-moe (DeepSeek-V3's 3 dense of 61 layers, 256 experts top-8) on 256 H100s at
global batch 512 of 4096 tokens. Each row prints the chosen plan, the search's CPU seconds
(the model prepared beforehand) and the candidates it priced, its step time and MFU, and
per layer kind (dense and MoE blocks) its all-to-all bytes on ep per micro-batch: 0 on the
dense blocks, which hold no experts.

(b) Measured, the MoE layer alone on a gloo world of 4 (float32): `autopar.kernels.moe.MoE`
split over ep = 4 against `autopar.kernels.sparse_moe.SparseMoE` whole on every rank, each rank
routing its own `--tokens` tokens of unit-variance noise (what the layer sees after its
RMSNorm at initialisation) through a router initialised as the zoo's (N(0, 0.02)). A step
is forward, backward and the gradient sync data parallelism needs: every gradient averaged
over the 4 ranks when experts are replicated; under ep 4 the router's only (each expert
lives on one rank, so its expert-data group is that rank). Median over `--steps` after one
warm-up. Expert weight bytes per rank are counted from the layer's tensors. Tokens per
expert: the rows each expert computed in the last forward (`MoE.last_tokens_per_expert`),
the busiest rank's rows over the mean beside the planner's prediction for the same sizes.
Tensor-parallel experts: the kernel with its tp group the world, each rank holding 1/4 of
every expert's FFN width and running the same global batch (the 4 ranks' tokens) as the
other two rows spread over their ranks; no gradient to sync (the router's is the same on
every tensor rank).

(c) Measured, the whole model through `autopar.parallelize`: plan=dict(expert=4), every
expert replicated over dp 4, and plan=dict(tensor=4) (tensor-parallel experts, no ep): the
same global batch and weights, so the losses agree; a plan this checkout refuses prints
"not run" and why. Nothing is estimated in its place.

Prints the tables and writes benchmarks/results/moe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_world import lm_loss, results_path, run_world  # noqa: E402

from autopar.cost.experts import routing_imbalance  # noqa: E402
from autopar.errors import PlanError  # noqa: E402
from autopar.kernels.collectives import AxisGroup, CommLog  # noqa: E402
from autopar.kernels.moe import MoE  # noqa: E402
from autopar.kernels.sparse_moe import SparseMoE  # noqa: E402
from autopar.models import workload  # noqa: E402
from autopar.search.planner import prepare, search, to_plan  # noqa: E402
from autopar.world import World  # noqa: E402

WORLD = 4
SPEC = "moe:layers=2,hidden=256,heads=4,experts=8,top_k=2"  # 4 heads: tp 4 splits them
BATCH, SEQ = 8, 256
HIDDEN, FFN, EXPERTS, TOP_K = 256, 896, 8, 2  # the spec's MoE layer (ffn 3.5 x hidden)
PLANS = {  # label -> the fixed part of the plan
    "ep 4 (dp 4)": dict(dp=4, ep=4, tp=1, pp=1, cp=1),
    "experts replicated (dp 4)": dict(dp=4, ep=1, tp=1, pp=1, cp=1),
    "tensor-parallel experts (tp 4)": dict(tp=4, dp=1, pp=1, cp=1, ep=1),
}
GiB = 1024 ** 3
DENSE_SPEC = "moe:layers=4,hidden=256,experts=8,top_k=2,dense=1"
SEARCHED = (  # (model, devices, device profile, global batch, seq, dtype)
    (DENSE_SPEC, WORLD, "cpu", BATCH, SEQ, "fp32"),
    ("deepseek-v3-moe", 256, "h100-80gb", 512, 4096, "bf16"),
)


def predicted() -> list[dict]:
    """(a): the planner's numbers for each fixed plan."""
    w = workload(SPEC, batch=1, seq=SEQ)
    chain = prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                    tp_sizes=(1, 4), layers=(w.traced_layers, w.layers))
    world = World(devices=WORLD, per_node=WORLD, device="cpu")
    rows = []
    for label, fixed in PLANS.items():
        result = search(chain, world, global_batch=BATCH, constraints=fixed, dtype="fp32")
        plan = to_plan(chain, world, result, BATCH, "fp32", 0.0)
        e = plan.detail["experts"]
        rows.append({"plan": label, "mesh": plan.to_json()["mesh"],
                     "step_time_s": plan.predicted["step_time_s"],
                     "memory_per_rank_bytes": plan.predicted["memory_per_device_bytes"],
                     "expert_weight_bytes_per_rank": e["expert_param_bytes_per_rank"],
                     "experts_per_rank": e["experts_per_rank"],
                     "tokens_per_expert": e["tokens_per_expert_per_microbatch"],
                     "tokens_per_expert_busiest": e["tokens_per_expert_busiest"],
                     "all_to_all_bytes_per_step": e["all_to_all_bytes_per_step"],
                     "note": "each expert's FFN split over tp" if fixed["tp"] > 1 else ""})
    return rows


def searched() -> list[dict]:
    """(a'): the plan the search chooses for each dense-first model of SEARCHED."""
    rows = []
    for model, devices, device, batch, seq, dtype in SEARCHED:
        w = workload(model, batch=1, seq=seq)
        world = World(devices=devices, per_node=min(devices, 8), device=device)
        chain = prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                        tp_sizes=tuple(t for t in (1, 2, 4, 8) if devices % t == 0),
                        layers=w.layer_counts)
        start = time.process_time()
        result = search(chain, world, global_batch=batch, dtype=dtype)
        search_cpu_s = time.process_time() - start  # the search alone, its model prepared
        plan = to_plan(chain, world, result, batch, dtype, 0.0)
        kinds = {k["ffn"]["kind"]: {"span": k["span"], "layers": k["layers"],
                                    "all_to_all_bytes_per_microbatch":
                                    k["ffn"]["all_to_all_bytes"]}
                 for k in plan.detail["layer_kinds"] if k.get("ffn")}
        rows.append({"model": model, "devices": devices, "device": device, "batch": batch,
                     "seq": seq, "plan": result.best.describe(), "ep": plan.ep,
                     "step_time_s": plan.predicted["step_time_s"],
                     "mfu": plan.predicted["mfu"], "kinds": kinds,
                     "search_cpu_s": search_cpu_s, "candidates": result.candidates})
    return rows


LAYOUTS = ("ep", "replicated", "tp")


def _layer(layout: str) -> torch.nn.Module:
    torch.manual_seed(0)
    full = SparseMoE(HIDDEN, FFN, EXPERTS, TOP_K)
    if layout == "ep":
        return MoE.shard(full, dist.group.WORLD)
    if layout == "replicated":
        return full
    tp = AxisGroup("tp", WORLD, dist.get_rank(), dist.group.WORLD, CommLog())
    part = slice(tp.rank * FFN // WORLD, (tp.rank + 1) * FFN // WORLD)
    layer = MoE(HIDDEN, FFN // WORLD, EXPERTS, TOP_K, tp=tp)
    layer.load_state_dict({"gate.weight": full.gate.weight, "w1": full.w1[:, part],
                           "w3": full.w3[:, part], "w2": full.w2[:, :, part]})
    return layer


def _sync(layer: torch.nn.Module, layout: str) -> None:
    """Average the gradients data parallelism shares: all of them with experts replicated,
    the router's alone under ep = world (each expert's only copy is on its rank), none with
    the experts split over tp (every rank ran the same tokens)."""
    for name, p in layer.named_parameters():
        if layout == "tp" or (layout == "ep" and name in ("w1", "w2", "w3")):
            continue
        dist.all_reduce(p.grad)
        p.grad /= WORLD


def layer_worker(rank: int, steps: int, tokens: int, out_dir: str) -> None:
    torch.manual_seed(100 + rank)
    x = torch.randn(tokens, HIDDEN)  # unit variance, as after the RMSNorm at initialisation
    every = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(every, x)
    out = {}
    for layout in LAYOUTS:
        layer = _layer(layout)
        tokens_in = torch.cat(every) if layout == "tp" else x  # tp: the 4 ranks' tokens
        times = []
        for step in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            y = layer(tokens_in)
            y.square().mean().backward()
            _sync(layer, layout)
            took = time.perf_counter() - start
            if step:
                times.append(took)
            layer.zero_grad(set_to_none=True)
        experts = sum(p.numel() * p.element_size() for n, p in layer.named_parameters()
                      if n in ("w1", "w2", "w3"))
        held = sum(p.numel() * p.element_size() for p in layer.parameters())
        out[layout] = {
            "step_s": statistics.median(times), "expert_weight_bytes": experts,
            "parameter_and_gradient_bytes": 2 * held,
            "rows_per_local_expert": layer.last_tokens_per_expert.tolist()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def measured_layer(steps: int, tokens: int) -> dict:
    """(b): the MoE layer alone on a gloo world of 4."""
    with tempfile.TemporaryDirectory() as d:
        run_world(layer_worker, (steps, tokens, d), WORLD)
        ranks = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(WORLD)]
    out = {}
    for key in LAYOUTS:
        per_rank = [r[key] for r in ranks]
        row = {"step_s": max(r["step_s"] for r in per_rank),
               "expert_weight_bytes_per_rank": per_rank[0]["expert_weight_bytes"],
               "parameter_and_gradient_bytes_per_rank": per_rank[0]["parameter_and_gradient_bytes"]}
        if key == "ep":
            rows = [sum(r["rows_per_local_expert"]) for r in per_rank]  # rows each rank ran
            per_expert = [n for r in per_rank for n in r["rows_per_local_expert"]]
            mean = sum(rows) / WORLD
            row.update(tokens_per_expert_mean=sum(per_expert) / EXPERTS,
                       busiest_rank_over_mean=max(rows) / mean,
                       predicted_tokens_per_expert=tokens * WORLD * TOP_K / EXPERTS,
                       predicted_busiest_over_mean=routing_imbalance(
                           EXPERTS, TOP_K, WORLD, tokens * WORLD, HIDDEN))
        out[key] = row
    whole = 3 * EXPERTS * HIDDEN * FFN * 4
    out["expert_weight_bytes_predicted"] = {"ep": whole // WORLD, "replicated": whole,
                                            "tp": whole // WORLD}
    return out


ENGINE_PLANS = (("ep 4", dict(expert=WORLD)),
                ("experts replicated (dp 4)", dict(zero=dict(stage=0))),
                ("tensor-parallel experts (tp 4)", dict(tensor=WORLD)))


def engine_worker(rank: int, out_dir: str, steps: int, which: int) -> None:
    """One plan of ENGINE_PLANS in its own world, so each peak RSS is that plan's alone."""
    import resource

    import autopar

    w = workload(SPEC, batch=BATCH, seq=SEQ)
    torch.manual_seed(0)  # the same global batch on every rank
    x = torch.randint(0, w.config.vocab_size, (BATCH, SEQ))
    result = {}
    for label, plan in ENGINE_PLANS[which:which + 1]:
        model, _ = autopar.models.build(w.config, batch=BATCH, seq=SEQ)  # on meta
        try:  # seed: both rows start from the same weights, so their losses agree
            engine = autopar.parallelize(model, WORLD, example_inputs=(x,), loss_fn=lm_loss,
                                         plan=plan, seed=0)
        except PlanError as e:
            result[label] = {"run": False, "why": str(e)}
            continue
        engine.train_step(x, x.roll(-1, 1))
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            loss = engine.train_step(x, x.roll(-1, 1))
            times.append(time.perf_counter() - start)
        held = sum(p.numel() * p.element_size() for p in engine.parameters())
        load = engine.expert_load()
        routed = {name: torch.tensor(v["routed"]) for name, v in load.items()}
        copies = plan.get("tensor", 1)  # tensor ranks route the same tokens
        for t in routed.values():
            dist.all_reduce(t)  # tokens per expert over the global batch
            t //= copies
        row = {"run": True, "step_s": statistics.median(times), "loss": loss,
               "parameter_bytes": held,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "tokens_per_expert": {k: v.tolist() for k, v in routed.items()}}
        rows = [None] * WORLD
        dist.all_gather_object(rows, row)
        result[label] = {**row, "parameter_bytes": max(r["parameter_bytes"] for r in rows),
                         "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rows)}
        del engine
    if rank == 0:
        with open(os.path.join(out_dir, f"engine{which}.json"), "w") as f:
            json.dump(result, f)


def measured_engine(steps: int) -> dict:
    """(c): the whole model through parallelize: ep 4, experts replicated, and experts
    split over tp 4, each plan in a fresh world of 4 processes."""
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for which in range(len(ENGINE_PLANS)):
            run_world(engine_worker, (d, steps, which), WORLD)
            out.update(json.load(open(os.path.join(d, f"engine{which}.json"))))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank, (b)")
    parser.add_argument("--skip-measured", action="store_true")
    args = parser.parse_args()
    result = {"spec": SPEC, "world": WORLD, "predicted": predicted(), "searched": searched()}
    print(f"(a) predicted: {SPEC}, {WORLD} x cpu, batch {BATCH} x {SEQ} tokens, fp32")
    print(f"  {'plan':<32} {'step':>9} {'mem/rank':>10} {'experts/rank':>12} "
          f"{'expert wts':>10} {'tok/expert':>10} {'busiest':>8} {'a2a/step':>10}")
    for r in result["predicted"]:
        print(f"  {r['plan']:<32} {1e3 * r['step_time_s']:>7.1f}ms "
              f"{r['memory_per_rank_bytes'] / 2 ** 20:>8.1f}Mi {r['experts_per_rank']:>12} "
              f"{r['expert_weight_bytes_per_rank'] / 2 ** 20:>8.2f}Mi "
              f"{r['tokens_per_expert']:>10.0f} {r['tokens_per_expert_busiest']:>8.0f} "
              f"{r['all_to_all_bytes_per_step'] / 2 ** 20:>8.2f}Mi"
              + (f"  ({r['note']})" if r["note"] else ""))
    print("\n(a') predicted: the search's choice for dense-first MoE models")
    for r in result["searched"]:
        print(f"  {r['model']} on {r['devices']} x {r['device']}, batch {r['batch']} x "
              f"{r['seq']}: {r['plan']}")
        print(f"    search {r['search_cpu_s']:.2f} CPU s over {r['candidates']} candidates "
              "(the model prepared before it)")
        print(f"    step {r['step_time_s']:.3f} s, MFU {100 * r['mfu']:.1f}%; "
              + "; ".join(f"{kind} blocks {k['span']} ({k['layers']}): all-to-all on ep "
                          f"{k['all_to_all_bytes_per_microbatch'] / 2 ** 20:.2f} MiB per "
                          "micro-batch" for kind, k in r["kinds"].items()))
    if not args.skip_measured:
        layer = result["measured_layer"] = measured_layer(args.steps, args.tokens)
        print(f"\n(b) measured: the MoE layer alone, {WORLD} gloo ranks, {args.tokens} tokens "
              "per rank, fp32")
        for key, label in (("ep", "ep 4"), ("replicated", "experts replicated (dp 4)"),
                           ("tp", "tensor-parallel experts (tp 4)")):
            r = layer[key]
            print(f"  {label:<32} step {1e3 * r['step_s']:>7.1f} ms, expert weights per rank "
                  f"{r['expert_weight_bytes_per_rank'] / 2 ** 20:.2f} MiB (predicted "
                  f"{layer['expert_weight_bytes_predicted'][key] / 2 ** 20:.2f} MiB)")
        r = layer["ep"]
        print(f"  tokens per expert: measured mean {r['tokens_per_expert_mean']:.0f}, predicted "
              f"{r['predicted_tokens_per_expert']:.0f}; busiest rank / mean: measured "
              f"{r['busiest_rank_over_mean']:.3f}, predicted {r['predicted_busiest_over_mean']:.3f}")
        engine = result["measured_engine"] = measured_engine(args.steps)
        print(f"\n(c) the whole model through parallelize, {WORLD} gloo ranks, batch {BATCH} x "
              f"{SEQ}, median of {args.steps} steps (max over ranks for bytes)")
        for label, _ in ENGINE_PLANS:
            r = engine[label]
            if not r["run"]:
                print(f"  {label:<32} not run: {r['why']}")
                continue
            print(f"  {label:<32} step {1e3 * r['step_s']:>7.1f} ms, parameters per rank "
                  f"{r['parameter_bytes'] / 2 ** 20:.2f} MiB, peak RSS "
                  f"{r['peak_rss_bytes'] / 2 ** 30:.2f} GiB, loss {r['loss']:.6f}")
            expected = BATCH * SEQ * TOP_K / EXPERTS
            for name, counts in r["tokens_per_expert"].items():
                local = EXPERTS // WORLD  # rank r holds experts r*local ... (r+1)*local - 1
                ranks = [sum(counts[i:i + local]) for i in range(0, EXPERTS, local)]
                by_rank = f", busiest ep rank / mean {max(ranks) / (expected * local):.3f}" \
                    if label.startswith("ep") else ""
                print(f"    {name}: tokens per expert {counts} (balanced: {expected:.0f}; "
                      f"busiest expert / mean {max(counts) / expected:.3f}{by_rank})")
    with open(results_path("moe.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
