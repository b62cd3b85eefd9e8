"""Step time beside torch's own engines: DDP, FSDP2, DTensor tensor parallelism, pipelining.

    python benchmarks/bench_peers.py [--world 2] [--model gpt:layers=4,hidden=256,...]
                                     [--batch 16] [--steps 16] [--warmup 3]
                                     [--groups data tensor pipeline]

One gloo world on this machine; one invocation times every pair at that world. Every rank
builds the same model from one seed and trains it, on the same global batch with AdamW,
under each engine of a pair:

    autopar data N            vs  DistributedDataParallel
    autopar ZeRO-1 / ZeRO-2   (for reference, beside DDP: their bytes equal an all-reduce)
    autopar ZeRO-3            vs  FSDP2 (fully_shard on every block, then on the model)
    autopar tensor 1D, tp N   vs  DTensor parallelize_module (Colwise/RowwiseParallel), LLaMA
    autopar pipeline 1F1B     vs  a hand-split torch.distributed.pipelining Schedule1F1B:
                                  pp2 at world 2, pp2 x dp2 at world 4 (stages in DDP)

The engines take turns step by step (A B C, then C B A, ...), so a burst of load from
elsewhere on the shared machine hits them alike; each row reports the median of its
measured steps and, from the same run, its ratio to its peer: the median over the rounds
of its step time over the peer's in that round (each pair of steps ran under the same
load; "med/med", the ratio of the two medians, is printed beside it). The last step's
losses are printed too: the engines of each pair train the same model on the same data and
agree to float rounding (the hand-split pipeline keeps the GPT's tied embedding tied by
summing its two copies' gradients). Prints a table; writes
benchmarks/results/peers_world<N>.json.
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

MODEL = "gpt:layers=4,hidden=256,heads=8,vocab=2048,seq=64"
# row -> (what runs, its peer's row)
# the tensor-parallel pair runs a LLaMA: separate q, k, v projections, which
# ColwiseParallel splits by heads (a fused QKV weight would be split across q, k and v)
TP_MODEL = "llama:layers=4,hidden=256,heads=8,kv_heads=8,ffn=688,vocab=2048,seq=64"
# group -> {row: its peer's row (None: the peer itself)}
ROWS = {"data": {"autopar data": "DDP", "autopar zero 1": "DDP", "autopar zero 2": "DDP",
                 "autopar zero 3": "FSDP2", "DDP": None, "FSDP2": None},
        "tensor": {"autopar tensor 1d": "DTensor TP", "DTensor TP": None},
        "pipeline": {"autopar pipeline 1f1b": "pipelining 1f1b", "pipelining 1f1b": None}}
MICROBATCHES = 4
PIPE_STAGES = 2  # the pipeline pair: pp2, times dp over the rest of the world


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
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import autopar

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
    fsdp = copy.deepcopy(model)
    for block in fsdp.blocks:
        fully_shard(block)
    fully_shard(fsdp)
    steps["DDP"] = eager_step(ddp, adamw(ddp.parameters()), *mine, world_mean)
    steps["FSDP2"] = eager_step(fsdp, adamw(fsdp.parameters()), *mine, world_mean)
    return steps


def _tensor_engines(world: int, batch: int) -> dict:
    """autopar's 1D plan beside torch's DTensor `parallelize_module` with ColwiseParallel
    (q, k, v, gate, up) and RowwiseParallel (o, down) on every block: each rank trains on
    the whole batch, heads split over the ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    model, x, y = _model(TP_MODEL, batch)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4)
    engine = autopar.parallelize(copy.deepcopy(model), world, example_inputs=(x[:2],),
                                 loss_fn=lm_loss, optimizer=adamw,
                                 plan={"tensor": {"size": world, "mode": "1d"}})
    mesh = init_device_mesh("cpu", (world,))
    dt = dtensor_tensor_parallel(copy.deepcopy(model), mesh, world)
    return {"autopar tensor 1d": functools.partial(engine.train_step, x, y),
            "DTensor TP": eager_step(dt, adamw(dt.parameters()), x, y, float)}


class _Stage(torch.nn.Module):
    """Blocks [a, b) of a GPT, with its embeddings first (stage 0) or its head last."""

    def __init__(self, gpt, a: int, b: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.blocks = torch.nn.ModuleList(gpt.blocks[a:b])
        if last:
            self.ln_f = gpt.ln_f
            self.lm_head = torch.nn.Linear(gpt.ln_f.normalized_shape[0],
                                           gpt.wte.num_embeddings, bias=False)
            with torch.no_grad():  # the tied embedding's copy (stages hold their own)
                self.lm_head.weight.copy_(gpt.wte.weight)

    def forward(self, x):
        if self.first:
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.size(1))))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def _pipeline_engines(spec: str, world: int, batch: int) -> dict:
    """autopar's pipeline (its planner's stages, 1F1B) beside a hand-split one on
    torch.distributed.pipelining, both on PIPE_STAGES stages, the world's other factor
    data parallel: at world 2 a plain pp2, at world 4 pp2 x dp2.

    pp2 x dp2 rather than pp4 at world 4: a few stages with data parallelism around them
    is how pipelines run (pp over the slow links, dp over the rest), and it keeps the
    per-stage work of the world-2 pair; pp4 of a 4-block GPT would be one block per
    stage with the head and embeddings on the ends. Both sides use the ("pp", "dp")
    rank layout autopar's mesh has (pipeline outermost).

    The hand-split is the idiomatic run: the GPT's blocks cut evenly, embeddings on the
    first stage, the head on the last, a PipelineStage per rank under Schedule1F1B, each
    stage module wrapped in DDP over its dp group when dp > 1 (PipelineStage runs the
    micro-batches but the last under no_sync, so DDP's bucketed all-reduce overlaps the
    last backward). The head holds a copy of the tied embedding (torch's stages cannot
    share a parameter) whose gradient is summed with the embedding's after the schedule,
    as Megatron-LM does, so both sides train the same tied model and their losses agree."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel

    import autopar

    pp = PIPE_STAGES
    dp = world // pp
    model, x, y = _model(spec, batch)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4)
    plan = {"pipeline": {"size": pp, "schedule": "1f1b", "microbatches": MICROBATCHES}}
    if dp > 1:
        plan["data"] = dp
    engine = autopar.parallelize(copy.deepcopy(model), world, example_inputs=(x[:2],),
                                 loss_fn=lm_loss, optimizer=adamw, plan=plan)
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    stage_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    pp_group = mesh["pp"].get_group()
    first, last = stage_rank == 0, stage_rank == pp - 1
    n, per = batch // dp, len(model.blocks) // pp
    x_all, y_all = x, y  # autopar takes the global batch, the hand-split its replica's
    x, y = x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]
    mine = _Stage(copy.deepcopy(model), stage_rank * per, (stage_rank + 1) * per, first, last)
    tied = mine.wte.weight if first else mine.lm_head.weight if last else None
    micro = n // MICROBATCHES
    hidden = model.ln_f.normalized_shape[0]
    # examples that say which values carry gradients (torch's stages read it from them)
    example_in = x[:micro] if first else \
        torch.zeros(micro, x.size(1), hidden).requires_grad_()
    example_out = mine(example_in)
    module = DistributedDataParallel(mine, process_group=mesh["dp"].get_group()) \
        if dp > 1 else mine
    stage = PipelineStage(module, stage_rank, pp, torch.device("cpu"),
                          input_args=(example_in,),
                          output_args=(example_out.detach().requires_grad_(),),
                          group=pp_group)
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=lm_loss)
    opt = adamw(mine.parameters())
    # the tied pair lies on the first and the last stage: with two stages, the pipeline
    tie_group = pp_group

    def torch_step():
        losses = []
        if first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        if tied is not None:
            dist.all_reduce(tied.grad, group=tie_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = torch.zeros(1)
        if losses:
            value[0] = torch.stack([v.detach() for v in losses]).mean()
        dist.all_reduce(value)  # the last stages' means, summed over the dp replicas
        return float(value) / dp

    return {"autopar pipeline 1f1b": functools.partial(engine.train_step, x_all, y_all),
            "pipelining 1f1b": torch_step}


def worker(rank, world, spec, batch, steps, warmup, groups, out_path):
    warnings.filterwarnings("ignore")
    rows = []
    for group in groups:
        engines = {"data": lambda: _engines(spec, world, batch),
                   "tensor": lambda: _tensor_engines(world, batch),
                   "pipeline": lambda: _pipeline_engines(spec, world, batch)}[group]()
        times = {row: [] for row in engines}
        losses = {}
        for step in range(warmup + steps):
            # every other round in reverse, so no engine always runs after the same one
            for row, run in list(engines.items())[::1 if step % 2 == 0 else -1]:
                dist.barrier()
                start = time.perf_counter()
                losses[row] = run()
                dist.barrier()
                if step >= warmup:
                    times[row].append(time.perf_counter() - start)
        medians = {row: statistics.median(t) for row, t in times.items()}
        for row, peer in ROWS[group].items():
            paired = statistics.median(a / b for a, b in zip(times[row], times[peer])) \
                if peer else None
            rows.append({"group": group, "engine": row, "peer": peer,
                         "median_s": medians[row], "times_s": times[row],
                         "loss": losses[row], "ratio": paired,
                         "ratio_of_medians": medians[row] / medians[peer] if peer else None})
        del engines
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": world, "model": spec, "tp_model": TP_MODEL, "batch": batch,
                       "steps": steps, "warmup": warmup, "microbatches": MICROBATCHES,
                       "pipeline": {"pp": PIPE_STAGES, "dp": world // PIPE_STAGES},
                       "device": "cpu (gloo)", "threads_per_rank": torch.get_num_threads(),
                       "rows": rows}, f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--groups", nargs="+", default=list(ROWS), choices=list(ROWS),
                        help="which pairs to time (default all)")
    args = parser.parse_args()
    if "pipeline" in args.groups and args.world % PIPE_STAGES:
        parser.error(f"the pipeline pair runs pp{PIPE_STAGES} x dp: use an even --world")
    out_path = results_path(f"peers_world{args.world}.json")
    run_world(worker, (args.world, args.model, args.batch, args.steps, args.warmup,
                       args.groups, out_path), args.world)
    with open(out_path) as f:
        result = json.load(f)
    print(f"{args.model}, world {args.world} (gloo, CPU), global batch {args.batch}, AdamW; "
          f"median of {args.steps} steps after {args.warmup}, engines taking turns")
    pipe = f"pp{PIPE_STAGES}" + (f" x dp{args.world // PIPE_STAGES}"
                                 if args.world > PIPE_STAGES else "")
    print(f"(tensor pair: {TP_MODEL}, tp{args.world}; pipeline pair: {pipe}, "
          f"{MICROBATCHES} micro-batches per replica)")
    print(f"{'engine':<22} {'step s':>9} {'peer':>16} {'ratio':>7} {'med/med':>8} "
          f"{'last loss':>11}")
    for row in result["rows"]:
        ratio, of_medians = (f"{row[k]:.3f}" if row[k] is not None else "-"
                             for k in ("ratio", "ratio_of_medians"))
        print(f"{row['engine']:<22} {row['median_s']:>9.4f} {row['peer'] or '-':>16} "
              f"{ratio:>7} {of_medians:>8} {row['loss']:>11.6f}")
    print(f"written to {out_path}")


if __name__ == "__main__":
    main()
