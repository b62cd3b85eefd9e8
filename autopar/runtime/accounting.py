"""The bytes one train_step of an engine sends, per collective, axis and layer, from its plan
(what `engine.comm_log` measures byte for byte, pipeline traffic included; what runs outside
the step, the pipeline's weight fetch, is `engine.startup_log`'s: docs/communication.md)."""

from __future__ import annotations

import sympy
import torch.distributed as dist

from autopar.errors import PlanError
from autopar.graph.trace import BATCH
from autopar.kernels.float8 import Float8Linear
from autopar.modes import DP, DP_REPLICATE, DP_SHARD, EDP, EP, FULL, PP
from autopar.passes.precision import comm_factors
from autopar.runtime.measure import STEP
from autopar.runtime.metrics import FIELDS as METRIC_FIELDS


def predicted_comm(engine, global_batch: int) -> dict[tuple[str, str], int]:
    """Bytes per (collective, axis): the layers summed."""
    out: dict[tuple[str, str], int] = {}
    for (op, axis, _), nbytes in predicted_comm_by_layer(engine, global_batch).items():
        out[(op, axis)] = out.get((op, axis), 0) + nbytes
    return out


def predicted_comm_by_layer(engine, global_batch: int) -> dict[tuple[str, str, str], int]:
    """Bytes per (collective, axis, layer); what the step sends outside the graph (the
    gradient sync, ZeRO, the world's norms, a pipeline's sends, tied gradients and loss) is
    under layer STEP."""
    if engine.train_solution is None:
        raise PlanError("the training graph is traced at the first train_step; call it first.")
    pipeline = engine.pipeline
    local = global_batch // engine.groups[DP].size
    mine = engine.pipeline_layers() if pipeline is not None else None
    # a pipeline, or gradient accumulation without one, runs every collective of the graph
    # once per micro-batch, at the micro-batch's size
    runs = engine.microbatches
    layer_of = {n.name: n.meta["autopar"].layer for n in engine.train_graph.graph.nodes}
    by_layer: dict[tuple[str, str, str], int] = {}
    # under bf16/fp16 the model part's collectives move 16-bit values
    kept = engine.recompute.kept_inputs(engine.train_solution)
    for c, factor in comm_factors(engine.train_solution, engine.compute_dtype):
        if mine is not None and layer_of.get(c.where) not in mine:  # another rank's stage
            continue
        key = (c.op, c.axis, layer_of.get(c.where) or STEP)
        # a recomputed region's forward runs again in the backward, its collectives too
        again = c.phase == "forward" and c.where in engine.recompute.replayed and \
            id(c) not in kept
        nbytes = runs * (1 + again) * \
            int((sympy.sympify(c.bytes) * factor).subs(BATCH, local // runs))
        by_layer[key] = by_layer.get(key, 0) + nbytes
    for (op, axis), nbytes in {**_data_parallel(engine, runs), **_world(engine),
                               **_expert_data(engine, runs), **_pipeline(engine)}.items():
        key = (op, axis, STEP)
        by_layer[key] = by_layer.get(key, 0) + nbytes
    for key, nbytes in {**_dispatch(engine), **_float8(engine, runs, mine)}.items():
        by_layer[key] = by_layer.get(key, 0) + nbytes
    return by_layer


def _float8(engine, runs: int, mine) -> dict[tuple[str, str, str], int]:
    """fp8's amax all-reduces over tp (4 bytes per split operand of a float8 linear, per
    micro-batch: the input's and weight's in the forward, the output gradient's in the
    backward), in the linear's layer; this pipeline rank's stages only."""
    out: dict[tuple[str, str, str], int] = {}
    if engine.float8 is None:
        return out
    for node in engine.train_gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = engine.train_gm.get_submodule(node.target)
        layer = node.meta["autopar"].layer
        if not isinstance(module, Float8Linear) or not module.split or \
                (mine is not None and layer not in mine):
            continue
        key = ("all_reduce", module.axis, layer)
        out[key] = out.get(key, 0) + runs * sum(module.amax_bytes().values())
    return out


def _dispatch(engine) -> dict[tuple[str, str, str], int]:
    """The MoE layers' all-to-alls on ep, from the routing the step took (engine.expert_load:
    per forward the E counts, int64, then the rows out and back, mirrored in the backward),
    and their balance statistics' all-reduce over dp (2E + 1 floats, forward and backward)."""
    out: dict[tuple[str, str, str], int] = {}

    def add(op, axis, layer, nbytes):
        out[(op, axis, layer)] = out.get((op, axis, layer), 0) + nbytes

    itemsize = engine.compute_dtype.itemsize if engine.compute_dtype is not None else 4
    for m in engine.expert_layers():
        if m.routed is None:
            continue
        layer, experts = m.layer or STEP, m.spec.experts
        rows = int(m.routed.sum() + m.computed.sum()) * m.spec.hidden * itemsize
        # a recomputed layer's forward dispatches again in the backward (same routing)
        again = FULL == engine.recompute.modes.get(m.layer)
        if m.group.size > 1:  # (experts split over tp alone: no dispatch)
            add("all_to_all", EP, layer, (1 + again) * (m.runs * experts * 8 + rows) + rows)
        if m.with_aux:
            add("all_reduce", DP, layer, (2 + again) * m.runs * (2 * experts + 1) * 4)
    return out


def _expert_data(engine, runs: int) -> dict[tuple[str, str], int]:
    """The experts' gradient sync over their expert-data group (none with one rank there:
    ZeRO-3 then copies its pieces, as over a dp of 1)."""
    edp, zero = engine.grads.edp, engine.zero
    if edp is None or edp.size == 1:
        return {}
    if zero is not None:  # (ZeRO-2/3 reduce-scatter each micro-batch's gradients)
        graphs = [m for _, m in engine.pipeline.held_modules()] \
            if engine.pipeline is not None else [engine.train_gm]
        scattered, gathered, _ = zero.expert_traffic(runs, graphs)
        return {("reduce_scatter", EDP): scattered, ("all_gather", EDP): gathered}
    return {("all_reduce", EDP): sum(p.numel() * p.element_size() for p in
                                     engine.grads.trained() if engine.params.is_expert(p))}


def _data_parallel(engine, runs: int) -> dict[tuple[str, str], int]:
    """The gradient sync over dp, then the loss's all-reduce. Under HSDP ZeRO's gathers and
    reduce-scatters run on dp_shard, and each reduce-scattered piece is summed over
    dp_replicate (its bytes: the reduce-scatter's over the shard size)."""
    if engine.grads.sync_ranks == 1:
        return {}
    zero = engine.zero
    hybrid = engine.plan.dp_replicate > 1
    axis = DP_SHARD if hybrid else DP
    if zero is not None:
        # ZeRO-1/2: the all-reduce's two halves, padded (ZeRO-2 reduce-scatters each
        # micro-batch's gradients); ZeRO-3: each layer gathered for its forward, again
        # where its backward needs it (an embedding's does not), its gradients
        # reduce-scattered per micro-batch, and under fp8 the float8 weights' amaxes
        # all-reduced before each of their gathers (under HSDP over the shard group, whose
        # pieces make each weight)
        scattered, gathered, amax = zero.traffic(runs, engine.train_units)
        out = {("all_reduce", DP): 4, ("reduce_scatter", axis): scattered,
               ("all_gather", axis): gathered}
        if amax:
            out[("all_reduce", axis)] = out.get(("all_reduce", axis), 0) + amax
    else:
        grad_bytes = sum(p.numel() * p.element_size() for p in engine.grads.data_parameters()
                         if p.requires_grad)
        # (beside cp one all-reduce over dp x cp, logged as dp; the loss's over dp alone)
        return {("all_reduce", DP): grad_bytes + (4 if engine.groups[DP].size > 1 else 0)}
    if hybrid:
        out[("all_reduce", DP_REPLICATE)] = out[("reduce_scatter", axis)] // zero.dp.size
    return out


def _pipeline(engine) -> dict[tuple[str, str], int]:
    """A pipeline member's own traffic on pp: its stages' point-to-point sends (activations
    forward, input gradients backward, per micro-batch), the all-reduce of the tied
    parameters' gradients over the members holding a copy (ZeRO-2/3: of this rank's
    pieces), the MoE balance loss's correction (two float64) and the loss's broadcast from
    the last stage's member (one float32)."""
    runner = engine.pipeline
    if runner is None:
        return {}
    reduced = sum(_tied_bytes(engine.zero, param) for param, _ in runner.tied())
    if runner.loss_correction is not None:
        reduced += 2 * 8
    out = {("p2p", PP): runner.sent_bytes(), ("broadcast", PP): 4}
    if reduced:
        out[("all_reduce", PP)] = reduced
    return out


def _tied_bytes(zero, param) -> int:
    """Bytes of a tied parameter's gradient as the pipeline members sum it: whole, or this
    rank's ZeRO piece where ZeRO-2/3 reduced it over dp first."""
    if zero is None:
        return param.numel() * param.element_size()
    return zero.tied_bytes(param)


def _world(engine) -> dict[tuple[str, str], int]:
    """The scalars summed over the whole world: norms and fp16's overflow flag."""
    world = 0
    if engine.max_grad_norm is not None:  # the squared norm
        world += 8
    optimizer = engine.optimizer
    if optimizer is not None and getattr(optimizer, "whole_norms", None) == \
            engine.grads.whole_norms:  # LAMB/LARS: two vectors of squared norms per group
        world += 2 * len(optimizer.param_groups) * 8 * len(engine.params.norm_index)
    if engine.scaler is not None:  # fp16: the overflow flag
        world += 4
    out = {}
    if engine.metrics is not None:  # runtime.metrics: the norm (when not clipping), the
        # ranks' figures gathered
        if engine.max_grad_norm is None:
            world += 8
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        out[("all_gather", "world")] = METRIC_FIELDS * 8 * ranks
    if world:
        out[("all_reduce", "world")] = world
    return out
