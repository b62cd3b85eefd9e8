"""`autopar.plan`: trace a model, read its layer costs, search, and return a Plan.

This is the offline path (no devices needed) and also what `parallelize(plan=None)`
runs, restricted to the modes the runtime executes.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import time
import weakref

import torch

from autopar.cost import fp8
from autopar.cost.layer import LayerChain
from autopar.cost.model import tensor_modes
from autopar.cost.precision import precision_of
from autopar.cost.step import chain_of
from autopar.errors import PlanError
from autopar.graph.trace import trace
from autopar.kernels.float8 import TENSORWISE, check_recipe
from autopar.kernels.moe_layers import opaque_moe, priced_layers
from autopar.modes import (
    BF16,
    CONTIGUOUS,
    CP,
    DP,
    FP8,
    FP16,
    FP32,
    GRID_MODES,
    INTERLEAVED,
    MEGATRON_SP,
    NO_RECOMPUTE,
    NO_SP,
    ONE_F_ONE_B,
    PP,
    RING,
    RUNTIME,
    TP,
    TP_1D,
    TP_25D,
)
from autopar.plans import LayerPlan, PipelinePlan, Plan, ZeroPlan
from autopar.plans.views import views
from autopar.search import why
from autopar.search.search import (
    Candidate,
    Constraints,
    Options,
    Search,
    SearchResult,
    collector_paused,
    divisors,
)
from autopar.world import World, local_device

# the parameters' dtype of each precision: fp8 holds bf16 weights and casts the linear
# layers' GEMM operands to float8 (autopar.cost.fp8)
DTYPES = {FP32: torch.float32, BF16: torch.bfloat16, FP16: torch.float16, FP8: torch.bfloat16}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items() if name != FP8}

__all__ = ["DTYPES", "candidate_plan", "chain_of", "executable_candidates", "model_flops",
           "pipeline_stages", "plan", "prepare", "search", "to_plan"]


def prepare(model, example_inputs, *, loss_fn=None, example_target=None,
            repeat: dict[str, int] | None = None, tokens_per_sample: int | None = None,
            tp_sizes=(), layers: tuple[int, int] | dict[str, int] | None = None,
            chunked_loss: bool = True) -> LayerChain:
    """Trace `model` and read the cost of each kind of layer (once per kind); `layers=(traced,
    real)`: `traced` copies of the repeated block stand for `real` (autopar.models.workload);
    or {traced block: real copies} where the blocks are of several kinds (`Workload.repeat`:
    an MoE model's dense first layers and its MoE layers)."""
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    _check_repeat(repeat)
    with opaque_moe(model, priced_layers(model)):  # transformers' MoE blocks as the op
        traced = trace(model, tuple(example_inputs), loss_fn=loss_fn,
                       example_target=example_target, train=True)
    _check_repeat(repeat, [layer.name for layer in traced.layers])
    if isinstance(layers, dict):
        names = {layer.name for layer in traced.layers}
        missing = sorted(set(layers) - names)
        if missing:
            raise PlanError(f"the blocks {', '.join(missing)} that stand for repeated layers "
                            f"are not layers of the trace ({', '.join(sorted(names))}).")
        repeat = {**(repeat or {}), **layers}
    elif layers is not None and layers[1] != layers[0]:
        repeat = dict(repeat or {})
        repeat.update(_scale_blocks(traced, *layers))
    if tokens_per_sample is None:
        x = example_inputs[0]
        tokens_per_sample = int(x.shape[1]) if x.dim() > 1 and not x.dtype.is_floating_point \
            else 1
    return chain_of(traced, tokens_per_sample, tp_sizes, repeat, chunked_loss)


def _check_repeat(repeat, layer_names: list[str] | None = None) -> None:
    """`repeat` maps layers of the model to the whole number of copies each stands for:
    its form before tracing, its names (given `layer_names`) after."""
    if repeat is None:
        return
    if not isinstance(repeat, dict):
        raise PlanError(f"repeat must map layer names to copies, such as {{'blocks.1': 96}}, "
                        f"not a {type(repeat).__name__}.")
    for name, count in repeat.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise PlanError(f"repeat[{name!r}] is {count!r}; give the whole number of copies "
                            "(>= 1) that layer stands for.")
        if layer_names is not None and name not in layer_names:
            close = difflib.get_close_matches(str(name), layer_names, n=1)
            hint = f"closest '{close[0]}'; " if close else ""
            raise PlanError(f"repeat names {name!r}, which is not a layer of the model; name "
                            f"one of its layers ({hint}all: {', '.join(layer_names)}).")


def _check_top(top) -> None:
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise PlanError(f"top={top!r} must be a whole number >= 1: how many of the best plans "
                        "the search keeps.")


def pipeline_stages(traced, plan: Plan, global_batch: int, tokens_per_sample: int,
                    microbatches: int) -> list[int]:
    """The stage of each layer of `traced` for a plan that names a pipeline but not its
    stages: the planner's split for exactly this plan, on its profile (this machine's when
    it names none); the closest candidate's when nothing fits memory."""
    world = plan.world if isinstance(plan.world, World) else \
        World(devices=math.prod(plan.mesh.values()), device=local_device())
    chain = chain_of(traced, tokens_per_sample, (plan.mesh[TP],))
    pipe = plan.pipeline
    constraints = Constraints(pp=plan.mesh[PP], dp=plan.mesh[DP], cp=plan.mesh[CP],
                              tp=plan.mesh[TP], ep=plan.ep, schedule=pipe.schedule, zero=0,
                              recompute=NO_RECOMPUTE, offload=False,
                              tp_mode=plan.grid_mode() if plan.mesh[TP] > 1 else None,
                              microbatches=microbatches,
                              chunks=pipe.chunks if pipe.schedule == INTERLEAVED else None,
                              sp=plan.sequence_mode if plan.mesh[CP] > 1 else None)
    options = Options(global_batch=global_batch, dtype=FP32, top=1)
    result = Search(chain, world, options, constraints).run()
    best = result.best or min((c for c, _ in result.alternatives if c.stages),
                              key=lambda c: c.memory_per_device, default=None)
    if best is None:
        raise PlanError("the planner finds no pipeline split for this plan.")
    return list(best.stages)


def _scale_blocks(traced, traced_count: int, real_count: int) -> dict[str, int]:
    """The last traced copy of the block repeated `traced_count` times stands for the rest:
    numbered copies (`layers.0`, `layers.1`) first, since other layers can repeat as often
    (BERT's two LayerNorms outside its encoder)."""
    groups: dict[int, list[str]] = {}
    for layer in traced.layers:
        groups.setdefault(layer.group, []).append(layer.name)

    def numbered(names: list[str]) -> bool:
        found = [re.match(r"^(.*)\.(\d+)$", name) for name in names]
        return all(found) and len({m.group(1) for m in found}) == 1

    repeated = [names for names in groups.values() if len(names) == traced_count]
    for names in sorted(repeated, key=numbered, reverse=True):
        if traced_count >= 1 and real_count > traced_count:
            return {names[-1]: real_count - traced_count + 1}
    raise PlanError(f"cannot find the block repeated {traced_count} times to stand for "
                    f"{real_count}.")


def search(chain: LayerChain, world: World, *, global_batch: int, constraints=None,
           dtype: str = BF16, attention_kernel: str = "flash", executable: bool = False,
           top: int = 5, progress=None, compile: bool = False,
           fp8_recipe: str = TENSORWISE) -> SearchResult:
    _check_top(top)
    options = Options(global_batch=global_batch, dtype=dtype, attention_kernel=attention_kernel,
                      executable=RUNTIME if executable else None, top=top, compile=compile,
                      fp8_recipe=check_recipe(fp8_recipe))
    # paused here, not only inside run: the searches' caches are freed before the collector
    # resumes, so its first collection has nothing of theirs to walk
    with collector_paused():
        if not executable:
            return Search(chain, world, options, constraints).run(progress)
        return _executable_search(chain, world, options, constraints, progress)


def _grids(world: int) -> list:
    """The multi-dimensional grids a tensor group of this world can form: (mode, depth)."""
    out = []
    for tp in (d for d in divisors(world) if d >= 4):
        for mode in tensor_modes(tp, GRID_MODES):
            grid = (mode.name, mode.d if mode.name == TP_25D else None)
            if grid not in out:
                out.append(grid)
    return out


def _narrowed(options: Options, grid, sp_seq: int | None) -> Options:
    """`options` restricted to 1D layers and at most one grid (mode, 2.5D depth), with
    Megatron-SP where the runtime can split this model's sequence (`sp_seq`)."""
    caps = options.executable
    modes = (TP_1D,) + ((grid[0],) if grid else ())
    caps = dataclasses.replace(
        caps, tp_modes=tuple(m for m in caps.tp_modes if m in modes),
        tp_depth=grid[1] if grid else None,
        sequence_parallel=caps.sequence_parallel if sp_seq else ())
    return dataclasses.replace(options, executable=caps, sp_seq=sp_seq)


def _sequence_parallel_length(chain: LayerChain, world: int) -> int | None:
    """The sequence length Megatron-SP would split, when the runtime can run it on this
    model (token sequences, every layer's partial sums splittable); else None."""
    from autopar.sharding.solve import solve, tokens_per_sample

    if chain.traced is None:
        return None
    seq = tokens_per_sample(chain.traced)
    sizes = [t for t in divisors(world) if t > 1 and seq and seq % t == 0]
    if not sizes:
        return None
    # solved once per traced graph and size: a model searched again (other worlds, other
    # constraints, --min-devices) reads it back
    known = _SP_SOLVED.setdefault(chain.traced.gm, {})
    if sizes[0] not in known:
        try:
            solve(chain.traced, axis=TP, size=sizes[0], sequence_parallel=True)
            known[sizes[0]] = True
        except PlanError:
            known[sizes[0]] = False
    return seq if known[sizes[0]] else None


_SP_SOLVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _executable_search(chain, world, options, constraints, progress) -> SearchResult:
    """The runtime runs one grid per plan (1D layers may join it): search 1D alone and 1D
    with each grid the world can form, and keep the fastest; the union of these spaces is
    exactly what `parallelize` can execute. A grid's search walks only the meshes whose
    tensor group can form it (elsewhere its space is the 1D one) and of those only the
    placements and micro-batches where its states add one a candidate can take to the 1D
    search's (`Prepared.adds_nothing`; elsewhere its candidates are the 1D search's), and
    skips what cannot beat the k best step times found so far and the candidates an earlier
    search priced alike (`settled`): the same top k as searching each space whole."""
    start = time.perf_counter()
    results, first, errors, times = [], None, [], []
    sp_seq = _sequence_parallel_length(chain, world.devices)
    state_costs: dict = {}  # the 1D layers' states priced once for every grid
    settled: dict = {}
    for grid in [None] + _grids(world.devices):
        opt = _narrowed(options, grid, sp_seq)
        search = Search(chain, world, opt, constraints, state_costs, base=first if grid else None,
                        settled=settled)
        first = first or search
        cutoff = times[options.top - 1] if len(times) >= options.top else float("inf")
        try:
            results.append(search.run(progress if grid is None else None, cutoff))
        except PlanError as e:  # kept without its frames: they would hold every search
            errors.append(e.with_traceback(None))
        times = sorted(times + search.best_times)
    if not results:
        raise errors[0]
    ranked = sorted((r.best for r in results if r.best), key=lambda c: c.step_time)
    best = ranked[0] if ranked else None
    others = ranked[1:] + [c for r in results for c, _ in r.alternatives]
    # the k best distinct plans but the winner, each with why it lost (asked of those alone)
    seen, alternatives = {best.describe()} if best is not None else set(), []
    for cand in sorted(others, key=lambda c: (not c.fits, c.step_time if c.fits else
                                              c.memory_per_device)):
        if len(alternatives) == options.top:
            break
        key = cand.describe()
        if key not in seen:
            seen.add(key)
            alternatives.append((cand, first.reason(cand, best)))
    return SearchResult(best, alternatives, sum(r.candidates for r in results),
                        time.perf_counter() - start, why.not_executable(options.executable),
                        options.attention_kernel, results[0].precision, options.compile,
                        options.fp8_recipe)


def executable_candidates(chain: LayerChain, world: World, *, global_batch: int,
                          dtype: str = FP32, attention_kernel: str = "flash",
                          constraints=None) -> list[Candidate]:
    """Every plan `parallelize` can execute that the executable search prices, fastest first
    and none skipped by a bound (`Search.every`): over 1D alone and with each grid (and each
    grid on every block), Megatron-SP off and on; alike `describe()`s are one, misfits kept."""
    base = Constraints.of(constraints)
    options = Options(global_batch=global_batch, dtype=dtype, attention_kernel=attention_kernel,
                      executable=RUNTIME, top=1)
    sp_seq = _sequence_parallel_length(chain, world.devices)
    sps = [base.sp] if base.sp is not None else [NO_SP, MEGATRON_SP]
    spaces = [(None, base.tp_mode)]
    for grid in _grids(world.devices):
        spaces += [(grid, base.tp_mode)] + ([(grid, grid[0])] if base.tp_mode is None else [])
    seen: dict[str, Candidate] = {}
    state_costs: dict = {}
    for grid, tp_mode in spaces:
        opt = _narrowed(options, grid, sp_seq)
        for sp in sps:
            fixed = dataclasses.replace(base, sp=sp, tp_mode=tp_mode)
            try:
                found = Search(chain, world, opt, fixed, state_costs).every()
            except PlanError:  # nothing under this grid, tensor mode and sp
                continue
            for cand in found:
                seen.setdefault(cand.describe(), cand)
    return sorted(seen.values(), key=lambda c: (not c.fits, c.step_time))


def candidate_plan(cand: Candidate, chain: LayerChain, world: World, global_batch: int,
                   dtype: str = FP32) -> Plan:
    """The Plan of one candidate, made as the planner makes its winner's (`to_plan`)."""
    result = SearchResult(cand, [], 1, 0.0,
                          precision=precision_of(chain.param_dtype))
    return _plan_of(cand, chain, world, result, global_batch, dtype, 0.0)


def plan(model, example_inputs, world, *, global_batch: int | None = None, constraints=None,
         loss_fn=None, example_target=None, dtype: str | None = None,
         attention_kernel: str = "flash", executable: bool = False, top: int = 5,
         repeat: dict[str, int] | None = None, progress=None, seq: int | None = None,
         precision: str | None = None, compile: bool = False,
         chunked_loss: bool = True, fp8_recipe: str = TENSORWISE) -> Plan:
    """The fastest plan for `model` (a module, or a transformers config path with
    example_inputs None and `seq` tokens) on `world` (devices, or a World) that fits memory;
    `constraints` fix any of `Constraints`' fields, `executable=True` plans what runs today;
    `repeat` {layer: copies} counts a traced layer as that many; `top` best plans are kept;
    `precision` (parallelize's name for it) or `dtype`: fp32, bf16, fp16 or fp8. `compile`
    prices the plan as parallelize(compile=True) runs it (inductor's fusion); `fp8_recipe`
    under fp8: "tensorwise" (Transformer Engine's, whose amaxes are all-reduced over tp) or
    "rowwise" (parallelize's default, no amax all-reduce; plan=None prices its own);
    `chunked_loss=False` prices the loss as `parallelize(..., chunked_loss=False)` runs it."""
    _check_top(top)
    dtype = _precision_of(dtype, precision)
    _check_repeat(repeat)
    world = world if isinstance(world, World) else World(devices=world)
    layers = None
    if isinstance(model, (str, os.PathLike)):
        if example_inputs is not None:
            raise PlanError("a config path builds its own example inputs; pass "
                            "example_inputs=None (and seq= for the sequence length).")
        from autopar.models import hf

        try:
            w = hf.workload(model, seq=seq, dtype=DTYPES[dtype or BF16])
        except ValueError as e:
            raise PlanError(str(e)) from e
        model, example_inputs, loss_fn, example_target = w.model, w.inputs, w.loss_fn, w.target
        layers = w.layer_counts
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    if global_batch is None:
        global_batch = int(example_inputs[0].shape[0])
    if dtype is None:
        dtype = _DTYPE_NAMES.get(next((p.dtype for p in model.parameters()), torch.float32),
                                 FP32)
    start = time.perf_counter()
    c = Constraints.of(constraints)
    sizes = [c.tp] if c.tp else [t for t in divisors(world.devices)]
    chain = prepare(model, example_inputs, loss_fn=loss_fn, example_target=example_target,
                    repeat=repeat, tp_sizes=sizes, layers=layers, chunked_loss=chunked_loss)
    result = search(chain, world, global_batch=global_batch, constraints=c, dtype=dtype,
                    attention_kernel=attention_kernel, executable=executable, top=top,
                    progress=progress, compile=compile, fp8_recipe=fp8_recipe)
    return to_plan(chain, world, result, global_batch, dtype, time.perf_counter() - start)


def _precision_of(dtype: str | None, precision: str | None) -> str | None:
    """The one precision `plan` was given, by either name, checked against DTYPES."""
    if dtype is not None and precision is not None and dtype != precision:
        raise PlanError(f"plan() got dtype='{dtype}' and precision='{precision}'; pass one "
                        f"of them (they name the same thing).")
    chosen = precision if precision is not None else dtype
    if chosen is not None and chosen not in DTYPES:
        raise PlanError(f"precision '{chosen}' is not one the planner prices; use one of "
                        f"{', '.join(DTYPES)}.")
    return chosen


def to_plan(chain: LayerChain, world: World, result: SearchResult, global_batch: int,
            dtype: str, total_s: float) -> Plan:
    best = result.best
    if best is None:
        raise PlanError(why.nothing_fits(result, world))
    made = _plan_of(best, chain, world, result, global_batch, dtype, total_s)
    made.detail = views().plan_report(made, chain)
    return made


def _plan_of(best: Candidate, chain: LayerChain, world: World, result: SearchResult,
             global_batch: int, dtype: str, total_s: float) -> Plan:
    block_states = [s for s, lt in zip(best.states, chain.layers()) if lt.is_block] or best.states
    main = max(block_states, key=lambda s: (block_states.count(s), str(s.mode)))
    layers = [LayerPlan(name, tp_mode=str(state.mode.name) if state.mode.size > 1 else TP_1D,
                        sp=state.sp, recompute=state.recompute, stage=stage)
              for name, state, stage in zip(chain.names, best.states, best.stages)]
    flops = model_flops(chain, global_batch)
    peak = world.profile.flops(fp8.MFU_PEAK if dtype == FP8 else dtype)
    mesh = best.mesh
    predicted = {
        "step_time_s": best.step_time,
        "compute_s": best.compute_s,
        "comm_s": best.comm_s + best.dp_comm_s,
        "tp_comm_s": best.comm_s,
        "ep_comm_s": best.ep_comm_s,
        "dp_comm_s": best.dp_comm_s,
        "bubble_s": best.bubble_s,
        "optimizer_s": best.optimizer_s,
        "memory_per_device_bytes": int(best.memory_per_device),
        "memory_breakdown_bytes": {k: int(v) for k, v in best.memory.items()},
        "optimizer_step_workspace_bytes": int(best.step_workspace),
        "host_memory_per_device_bytes": int(best.host_per_device),
        "comm_bytes_per_device": int(best.comm_bytes_per_device),
        "model_flops_per_step": flops,
        "mfu": flops / (best.step_time * world.devices * peak) if best.step_time else 0.0,
        "model_tflops_per_device": flops / (best.step_time * world.devices) / 1e12
        if best.step_time else 0.0,
        "mfu_peak": {"dtype": fp8.MFU_PEAK if dtype == FP8 else dtype, "flops": peak},
        "tokens_per_s": global_batch * chain.tokens_per_sample / best.step_time
        if best.step_time else 0.0,
    }
    alternatives = [{"plan": c.describe(), "mesh": c.mesh, "step_time_s": c.step_time,
                     "memory_per_device_bytes": int(c.memory_per_device), "fits": c.fits,
                     "reason": reason} for c, reason in result.alternatives]
    search_info = {"time_s": result.time_s, "total_s": total_s, "candidates": result.candidates,
                   "alternatives": alternatives, "left_out": result.left_out,
                   "winner": best.describe(), "dtype": dtype, "global_batch": global_batch,
                   "attention_kernel": result.attention_kernel, "compile": result.compile,
                   "fp8_recipe": result.fp8_recipe,
                   "precision": result.precision.to_json() if result.precision else None}
    sequence_mode = best.cp_mode if mesh[CP] > 1 else None
    # ring attention's zigzag layout needs 2 x cp chunks; else the contiguous one
    sequence_layout = CONTIGUOUS if sequence_mode == RING and \
        chain.tokens_per_sample % (2 * mesh[CP]) else None
    plan = Plan(mesh=dict(mesh), tp_mode=main.mode.name, tp_depth=main.mode.d if
                main.mode.name == TP_25D else 1,
                sequence_parallel=all(s.sp == MEGATRON_SP for s in best.states
                                      if s.mode.name == TP_1D and s.mode.size > 1)
                and main.sp == MEGATRON_SP,
                sequence_mode=sequence_mode,
                sequence_layout=sequence_layout,
                layers=layers,
                pipeline=PipelinePlan(schedule=best.schedule if mesh[PP] > 1 else ONE_F_ONE_B,
                                      microbatches=best.microbatches, chunks=best.chunks,
                                      micro_batch_size=best.micro_batch),
                zero=ZeroPlan(stage=best.zero, offload=best.offload, shard=best.dp_shard),
                recompute=main.recompute, world=world, predicted=predicted, search=search_info,
                notes=_notes(chain, mesh[TP]), ep=best.ep)
    return plan


def _notes(chain: LayerChain, tp: int) -> list[str]:
    """Notes on what the chosen plan does at its tensor size `tp`: a 1D split that size
    refuses, ops that run whole; the sizes it did not choose are left out."""
    notes = [note for note in getattr(chain, "refused", []) if note.startswith(f"tp={tp}:")]
    for lt in chain.types:
        sh = lt.sharded.get(tp)
        if tp > 1 and sh is not None and sh.replicated_ops:
            notes.append(f"{lt.name} at tp={tp}: " + "; ".join(sh.replicated_ops[:3])
                         + (f" (+{len(sh.replicated_ops) - 3} more)"
                            if len(sh.replicated_ops) > 3 else ""))
    return notes


def model_flops(chain: LayerChain, global_batch: int) -> int:
    """FLOPs of one step without recomputation: forward, plus backward at twice the forward
    (the 6-FLOPs-per-parameter-per-token rule with attention included)."""
    fwd = sum(lt.forward_flops(1) for lt in chain.layers())
    return int(3 * fwd * global_batch)
