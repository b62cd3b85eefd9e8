"""Step pricing: a training step's memory, gradient sync, optimizer and pipeline seconds.

The search prices its candidates with these functions and the reports reprice a plan with
them, so a plan's detail adds up to the figure that chose it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from autopar.cost.comm import Placement, collective_time, placements
from autopar.cost.hardware import Hardware
from autopar.cost.hybrid import HybridSplit, replicas_time, replicas_wire_bytes
from autopar.cost.layer import LayerChain, add_tensor_parallel, layer_chain
from autopar.cost.precision import ADAM_MOMENTS, Precision
from autopar.cost.schedule import in_flight, stage_count, step_time, time_shared
from autopar.cost.state import FOR_LOOP, FUSED
from autopar.modes import CP, DP, EP, NO_PIPELINE, PP, TP

USABLE_MEMORY = 0.92  # the rest goes to the framework, kernels' workspaces, fragmentation


def chain_of(traced, tokens_per_sample: int, tp_sizes=(), repeat: dict[str, int] | None = None,
             chunked_loss: bool = True) -> LayerChain:
    """The layer chain of a training trace, with each kind's costs at every tensor size
    (`chunked_loss`: a classifier's cross-entropy priced as the engine runs it by default)."""
    chain = layer_chain(traced, repeat=repeat, tokens_per_sample=tokens_per_sample)
    chain.chunked_loss = chunked_loss
    chain.refused = add_tensor_parallel(traced, chain, sorted({1, *tp_sizes}), chunked_loss)
    chain.traced = traced
    chain.names = layer_names(traced, repeat or {})
    return chain


def layer_names(traced, repeat: dict[str, int]) -> list[str]:
    """Layer names of the real model: a traced `blocks.1` standing for 95 blocks becomes
    blocks.1 ... blocks.95. Numbering goes on from the copies before: a traced `blocks.0`
    standing for 3 dense blocks and `blocks.1` for 58 MoE blocks become blocks.0 ...
    blocks.2 and blocks.3 ... blocks.60."""
    out = []
    next_index: dict[str, int] = {}  # per numbered prefix: the first index not yet named
    for layer in traced.layers:
        count = repeat.get(layer.name, 1)
        m = re.match(r"^(.*\.)(\d+)$", layer.name)
        if m:
            start = max(int(m.group(2)), next_index.get(m.group(1), 0))
            out.extend(f"{m.group(1)}{start + k}" for k in range(count))
            next_index[m.group(1)] = start + count
        else:
            out.extend([layer.name] * count)
    return out


def state_factors(precision: Precision, replicas: int, zero: int,
                  offload: bool) -> tuple[float, float, float]:
    """Bytes of (parameters, gradients, master + optimizer state) a device holds per byte of
    its layers' weights: ZeRO-1/2/3 shard optimizer, gradients, parameters over the replicas
    (Rajbhandari et al. 2019, §5); offload moves master and moments to the host."""
    w = precision.weights
    return (1 / (replicas if zero == 3 else 1),
            precision.gradients / w / (replicas if zero >= 2 else 1),
            0.0 if offload else (precision.master + precision.optimizer) / w
            / (replicas if zero else 1))


@dataclass(frozen=True)
class ExpertSplit:
    """Experts split over `ep` ranks inside the dp x cp replicas (Megatron-Core, DeepSpeed-MoE):
    `dispatch`, the ep groups (consecutive replicas, after tp); `data`, the dp x cp / ep ranks
    holding the same experts, which sync their gradients and over which ZeRO shards them."""

    ep: int
    dispatch: Placement
    data: Placement

    @property
    def replicas(self) -> int:
        return self.data.size


def expert_split(mesh: dict, ep: int, per_node: int) -> ExpertSplit:
    """Where the ep groups and the expert-data groups of `mesh` sit (ep divides dp x cp)."""
    replicas = mesh[DP] * mesh[CP]
    pl = placements({TP: mesh[TP], EP: ep, DP: replicas // ep, PP: mesh[PP]}, (TP, EP, DP, PP),
                    per_node)
    return ExpertSplit(ep, pl[EP], pl[DP])


def buffer_bytes(biggest: float, replicas: int, zero: int,
                 held: tuple[float, float] | None = None) -> float:
    """The flat buffers of the biggest layer (`biggest` parameter bytes on a device): twice
    for data-parallel sync where there are replicas, twice more for ZeRO-3's gathers. `held`
    (`zero3_held`): ZeRO-3's weights held across layers with their gradient, beside which
    the gathers take turns over the biggest layer's other bytes."""
    held_bytes, turn = (0.0, biggest) if held is None else held
    return (2 * biggest if replicas > 1 else 0.0) + \
        (held_bytes + 2 * turn if zero == 3 else 0.0)


def zero3_held(params, held, precision: Precision, pp: int) -> tuple[float, float] | None:
    """What ZeRO-3 holds across layers (`buffer_bytes`' `held`), from each layer's parameter
    bytes on a device and those of them a later layer reads too (`LayerType.held_bytes`): a
    tied embedding is gathered once, at the embedding, and held to the classifier's
    backward, and its two uses' gradients are summed whole to the embedding's backward
    before one reduce-scatter; so its gathered bytes and its whole gradient are held beside
    the layers gathered in turn. (None beside nothing held.) Under a pipeline the two uses
    lie on different stages, each gathering its own copy: nothing is held."""
    held = np.asarray(held, dtype=float)
    if pp > 1 or not held.any():
        return None
    rest = np.asarray(params, dtype=float) - held
    return float(held.sum()) * (1 + precision.gradients / precision.weights), float(rest.max())


def stage_memory(params, acts, in_flight, biggest: float, capacity: float,
                 precision: Precision, replicas: int, zero: int,
                 offload: bool) -> tuple[np.ndarray, np.ndarray]:
    """What balancing layers over pipeline ranks under memory needs: the bytes each layer
    puts on each rank ([ranks, layers]: its state, `state_factors` per byte of `params`, and
    its activations `acts` times the micro-batches `in_flight` there), and the bytes each
    rank has for them (`capacity` less the biggest layer's flat buffers, `buffer_bytes`)."""
    per_param = sum(state_factors(precision, replicas, zero, offload))
    weights = params[None, :] * per_param + in_flight[:, None] * acts[None, :]
    return weights, np.full(len(in_flight), capacity - buffer_bytes(biggest, replicas, zero))


def memory_by_kind(params_dev, acts_dev, biggest: float, replicas: int, zero: int,
                   offload: bool, in_flight, precision: Precision, workspace: float = 0.0,
                   experts_dev=None, split: ExpertSplit | None = None,
                   step_dev=None, held: tuple[float, float] | None = None) -> dict:
    """Bytes per device by kind (arrays over the pipeline ranks), which add up to its peak.
    Buffers: the biggest layer's flat buffers, twice for data-parallel sync and twice more
    for ZeRO-3's gathers (beside what it holds across layers, `held`: `zero3_held`), plus
    the largest transient `workspace` of one layer. Under expert
    parallelism (`split`) the `experts_dev` bytes among `params_dev` take ZeRO's factors
    over the expert-data group instead of every replica.

    The optimizer step runs after the backward has freed the activations and buffers, so
    the peak is parameters + gradients + optimizer + max(activations + buffers, the step's
    temporaries `step_dev` (`optimizer_step_dev`)); `optimizer_step` is what the step adds
    over the backward's peak, max(0, step_dev - activations - buffers)."""
    weights, grads, optim = state_factors(precision, replicas, zero, offload)
    buffers = np.full_like(params_dev, buffer_bytes(biggest, replicas, zero, held) + workspace)
    if split is None or experts_dev is None:
        dense, experts, factors = params_dev, None, None
    else:
        dense, experts = params_dev - experts_dev, experts_dev
        factors = state_factors(precision, split.replicas, zero, offload)
    activations = acts_dev * in_flight
    step = np.zeros_like(params_dev) if step_dev is None else step_dev
    if experts is None:  # (no experts' term: adding 0.0 to bytes >= 0 changes none)
        state = dense * weights, dense * grads, dense * optim
    else:
        state = (dense * weights + experts * factors[0], dense * grads + experts * factors[1],
                 dense * optim + experts * factors[2])
    return dict(parameters=state[0], gradients=state[1], optimizer=state[2], buffers=buffers,
                activations=activations,
                optimizer_step=np.maximum(0.0, step - activations - buffers))


def step_temps_dev(peak, first, last, device_of, pp: int) -> np.ndarray:
    """Per pipeline rank, the for-loop step's temporaries (`autopar.cost.state.StepTemps`)
    over its layers' parameter tensors in layer order: each layer's own peak, and where one
    layer follows another on the rank, twice its first tensor beside the last one's. Arrays
    per layer; a layer without parameters does not separate its neighbours. (One pass in
    layer order: a maximum is the same in any order, and each pair is summed as before.)"""
    peak, first, last = (np.asarray(a, dtype=float).tolist() for a in (peak, first, last))
    out = [0.0] * pp
    before: list = [None] * pp  # per rank, its last layer so far holding parameters
    for i, d in enumerate(np.asarray(device_of).tolist()):
        p = peak[i]
        if p > out[d]:
            out[d] = p
        if p > 0:
            j = before[d]
            if j is not None:
                pair = 2 * first[i] + last[j]
                if pair > out[d]:
                    out[d] = pair
            before[d] = i
    return np.array(out)


def optimizer_step_dev(params_dev, temps_dev, replicas: int, zero: int, offload: bool,
                       precision: Precision, implementation: str, experts_dev=None,
                       split: ExpertSplit | None = None) -> np.ndarray:
    """Bytes of the optimizer step's temporaries per device (torch.optim's, as
    `autopar.cost.state.step_workspace` prices AdamW's and `STEP_SOURCE` names): foreach,
    one moment's copy of every local parameter; for-loop, `temps_dev` (`step_temps_dev`, in
    weight bytes); fused, none. The temporaries take the moments' dtype, and under ZeRO the
    step runs on each rank's 1/replicas piece of every parameter (experts: 1/their
    expert-data ranks under foreach; the for-loop's largest pair is taken as dense).
    Offloaded, the step runs on the host: no device bytes."""
    params_dev = np.asarray(params_dev, dtype=float)
    if offload or implementation == FUSED:
        return np.zeros_like(params_dev)
    per_weight = precision.optimizer / ADAM_MOMENTS / precision.weights
    if implementation == FOR_LOOP:
        return np.asarray(temps_dev, dtype=float) * per_weight / (replicas if zero else 1)
    if split is None or experts_dev is None:
        return params_dev * per_weight / (replicas if zero else 1)
    dense = params_dev - experts_dev
    return (dense / (replicas if zero else 1) + experts_dev / (split.replicas if zero else 1)) \
        * per_weight


def host_bytes(param_bytes: float, replicas: int, zero: int, offload: bool,
               precision: Precision) -> float:
    """Bytes one device offloads to its host: its ZeRO shard's `Precision.offloaded`."""
    if not offload:
        return 0.0
    return param_bytes / precision.weights * precision.offloaded / (replicas if zero else 1)


def host_capacity(hw: Hardware, per_node: int, devices: int) -> float:
    """Host memory one device may offload to: its node's share."""
    return hw.host_memory_bytes / max(1, min(per_node, devices))


def optimizer_time(param_bytes: float, replicas: int, zero: int, offload: bool,
                   precision: Precision, hw: Hardware) -> float:
    """Seconds of one device's optimizer step: its shard's `step_bytes` at memory bandwidth,
    or, offloaded, gradient down, weights up and the step over the host link."""
    elements = param_bytes / precision.weights / (replicas if zero else 1)
    if offload:
        return elements * (precision.gradients + precision.weights + precision.step_bytes) \
            / hw.host_bandwidth
    return elements * precision.step_bytes / (hw.memory_bandwidth * hw.memory_efficiency)


def dp_wire_bytes(param_bytes: float, replicas: int, zero: int, gather: float = 1.0) -> float:
    """Bytes one device sends to sync its gradients (ring all-reduce or reduce-scatter +
    all-gather), half again under ZeRO-3, which also gathers for the backward; `gather`:
    ZeRO-3's gathered bytes over the weights' (`Precision.gather_ratio`, 1/2 under fp8)."""
    if replicas <= 1:
        return 0.0
    if zero == 3:
        return (replicas - 1) / replicas * param_bytes * (1 + 2 * gather)
    return 2 * (replicas - 1) / replicas * param_bytes


def dp_time(param_bytes: float, zero: int, m: int, grad_pl, hw: Hardware, units: int = 1,
            cache: dict | None = None, gather: float = 1.0) -> float:
    """Seconds of one device's gradient sync over `m` micro-batches (Rajbhandari et al.
    2019): ZeRO-3 gathers and reduce-scatters layer by layer, `units` layers each paying
    its own latency, each gathered for its forward and again for its backward but the last,
    whose forward gather the backward, which begins with it, keeps (as the runtime does,
    `runtime.zero3.kept_after_forward`). `cache`: seconds by parameter bytes, for this
    `grad_pl` and `gather` only; `gather`: ZeRO-3's gathered bytes over the weights' (fp8
    gathers float8)."""
    if grad_pl.size <= 1:
        return 0.0
    if zero == 3:
        units = max(1, units)
        _, rs, _, gathered = _sync_parts(param_bytes / units, grad_pl, hw, cache, gather)
        return m * (units * rs + (2 * units - 1) * gathered)
    ar, rs, ag, _ = _sync_parts(param_bytes, grad_pl, hw, cache, gather)
    return {0: ar, 1: rs + ag, 2: m * rs + ag}[zero]


def _sync_parts(param_bytes: float, grad_pl, hw: Hardware, cache: dict | None,
                gather: float) -> tuple:
    """(all-reduce, reduce-scatter, all-gather, gather at `gather`'s bytes) seconds of
    `param_bytes` over `grad_pl`, through `cache` (by parameter bytes)."""
    hit = cache.get(param_bytes) if cache is not None else None
    if hit is None:
        hit = tuple(collective_time(op, param_bytes, grad_pl, hw)
                    for op in ("all_reduce", "reduce_scatter", "all_gather")) + \
            (collective_time("all_gather", param_bytes * gather, grad_pl, hw),)
        if cache is not None:
            cache[param_bytes] = hit
    return hit


def sync_time(param_bytes: float, zero: int, m: int, grad_pl, hw: Hardware, units: int = 1,
              cache: dict | None = None, hybrid: HybridSplit | None = None,
              gather: float = 1.0) -> float:
    """`dp_time` over `grad_pl`; under HSDP (`hybrid`) over the shard group, plus the
    replicas' all-reduce of each piece (`cost.hybrid.replicas_time`); `cache`: seconds by
    bytes of the placement the ZeRO collectives run on (and the replicas' by their piece
    and placement, keyed apart); `gather` as `dp_time`'s."""
    if hybrid is None:
        return dp_time(param_bytes, zero, m, grad_pl, hw, units, cache, gather)
    return dp_time(param_bytes, zero, m, hybrid.shard, hw, units, cache, gather) + \
        replicas_time(param_bytes, zero, m, hybrid, hw, units, cache)


def sync_bytes(worst: float, replicas: int, zero: int, offload: bool, precision,
               hybrid: HybridSplit | None = None, split: ExpertSplit | None = None,
               experts: float = 0.0) -> tuple[float, float]:
    """(bytes offloaded to the host, bytes the gradient sync sends) per step for the rank
    holding `worst` parameter bytes, ZeRO over `replicas` ranks (HSDP: its shard group, the
    replicas' all-reduce added); `experts` of its bytes are MoE experts, which sync over
    their own expert-data group (`split`)."""
    host = host_bytes(worst, replicas, zero, offload, precision)
    gather = precision.gather_ratio
    wire = dp_wire_bytes(worst, replicas, zero, gather) + \
        (replicas_wire_bytes(worst - experts, hybrid) if hybrid is not None else 0.0)
    if split is not None:
        host += host_bytes(experts, split.replicas, zero, offload, precision) - \
            host_bytes(experts, replicas, zero, offload, precision)
        wire += dp_wire_bytes(experts, split.replicas, zero, gather) - \
            dp_wire_bytes(experts, replicas, zero, gather)
    return host, wire


def stage_transfer(layers, stage_of, b: int, pl: dict, hw: Hardware) -> tuple[float, float]:
    """(seconds, bytes) of one transfer between pipeline stages: each rank's 1/(tp x cp)
    slice of the biggest activation crossing a stage boundary (Narayanan et al. 2021 §4.1)."""
    crossing = [layers[i].boundary(b) for i in range(len(stage_of) - 1)
                if stage_of[i] != stage_of[i + 1]]
    return crossing_transfer(max(crossing) if crossing else None, pl, hw)


def crossing_transfer(biggest: float | None, pl: dict, hw: Hardware) -> tuple[float, float]:
    """`stage_transfer` of the biggest activation crossing a boundary (None: none does)."""
    if biggest is None:
        return 0.0, 0.0
    nbytes = biggest / (pl[TP].size * pl[CP].size)
    return collective_time("p2p", nbytes, pl[PP], hw), nbytes


def conversion_s(boundary_bytes: float, pl: dict, hw: Hardware) -> float:
    """Seconds to hand a layer's output to a neighbour of another layout: an all-gather over
    tp of this rank's cp share of it."""
    if pl[TP].size <= 1:
        return 0.0
    return collective_time("all_gather", boundary_bytes / max(1, pl[CP].size), pl[TP], hw)


def in_flight_of(schedule: str, pp: int, v: int, m: int) -> np.ndarray:
    """Micro-batches whose activations each pipeline rank holds at its peak."""
    if pp == 1:
        return np.ones(1)
    return np.array(in_flight(schedule, pp, m, v))


def pipeline_time(layer_time, device_of, stage_of, pp: int, v: int, m: int, schedule: str,
                  hw: Hardware, transfer: float = 0.0) -> tuple[float, float, np.ndarray]:
    """(step seconds of the pipeline, bubble seconds, per-rank seconds per micro-batch);
    `transfer`: seconds of one activation crossing a stage boundary."""
    dev = np.bincount(device_of, weights=layer_time, minlength=pp)
    if pp > 1:  # forward and backward cross each boundary, interleaving v times as many
        dev = dev + 2 * v * transfer
    slowest = float(dev.max())
    if pp == 1 or schedule == NO_PIPELINE:
        total = m * slowest
    elif hw.compute_share < 1:
        # ranks time-sharing fewer cores (CPU): a waiting rank's cores go to the busy ones
        stage_s = np.bincount(stage_of, weights=layer_time,
                              minlength=stage_count(schedule, pp, v)) + 2 * transfer
        total = time_shared(schedule, pp, m, stage_s, hw.compute_share, v)
    else:  # closed forms of autopar.cost.schedule (checked against its simulation)
        total = step_time(schedule, pp, m, dev.tolist(), v)
    return total, max(0.0, total - m * slowest), dev


def grad_placement(mesh: dict, per_node: int):
    """Where the gradient sync runs: the dp x cp replicas of a tensor rank."""
    return placements({TP: mesh[TP], "dpcp": mesh[DP] * mesh[CP], PP: mesh[PP]},
                      (TP, "dpcp", PP), per_node)["dpcp"]


def step_parts(layer_time, device_of, stage_of, params_dev, units: int, *, transfer: float,
               grad_pl, hw: Hardware, schedule: str, v: int, m: int, zero: int,
               offload: bool, precision: Precision, cache: dict | None = None,
               pipeline: tuple | None = None, experts_dev=None,
               split: ExpertSplit | None = None, hybrid: HybridSplit | None = None,
               expert_cache: dict | None = None) -> dict:
    """Seconds of one step by part: the pipeline (its bubble, each rank's seconds per
    micro-batch), the gradient sync and the optimizer of the rank holding most weights.
    `units`: that rank's layers holding parameters; `transfer`: `stage_transfer`'s seconds;
    `pipeline`: `pipeline_time` of these arguments when already known (ZeRO options of one
    leaf share it). Under expert parallelism (`split`) that rank's `experts_dev` bytes sync
    over the expert-data group and step on its ZeRO shard. Under HSDP (`hybrid`) ZeRO runs
    over the shard group and each piece is summed over the replicas (`cost.hybrid`).
    `cache`, `expert_cache`: `dp_time`'s, over `grad_pl` (HSDP: its shard group) and over
    `split.data`."""
    pp = len(params_dev)
    if pipeline is None:
        pipeline = pipeline_time(layer_time, device_of, stage_of, pp, v, m, schedule, hw,
                                 transfer)
    pipe, bubble, dev = pipeline
    worst = float(params_dev.max())
    replicas = grad_pl.size if hybrid is None else hybrid.ranks
    if split is not None and experts_dev is not None:
        experts = float(experts_dev[int(np.argmax(params_dev))])
        worst -= experts
        dp_s = dp_time(experts, zero, m, split.data, hw, units=max(1, units),
                       cache=expert_cache, gather=precision.gather_ratio)
        optimizer_s = optimizer_time(experts, split.replicas, zero, offload, precision, hw)
    else:
        dp_s = optimizer_s = 0.0
    dp_s += sync_time(worst, zero, m, grad_pl, hw, max(1, units), cache, hybrid,
                      precision.gather_ratio)
    optimizer_s += optimizer_time(worst, replicas, zero, offload, precision, hw)
    return {"step_s": pipe + dp_s + optimizer_s, "pipeline_s": pipe, "bubble_s": bubble,
            "per_rank_s": dev, "dp_s": dp_s, "optimizer_s": optimizer_s}
