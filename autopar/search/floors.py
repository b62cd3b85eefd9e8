"""Lower bounds on a multi-dimensional (2D, 2.5D, 3D) layer state's seconds, read from the
layer's sizes and the device's rates alone, without pricing the state (`cost.model`): an
executable search's grid search asks them before it prices a grid's states for a bound
(`least_floor`), and skips the (mesh, micro-batch) groups they already put past the k best.
"""

from __future__ import annotations

import math

import numpy as np

from autopar.cost import fp8
from autopar.cost.cp import context_floor
from autopar.cost.model import (
    ITEMSIZE,
    attention_time,
    gemm_time,
    grid_comm,
    local_gemm_shape,
    memory_time,
    state_params,
)
from autopar.modes import CP, FP8, FULL, MEGATRON_SP, TP, TP_1D
from autopar.search.prepared import least_recompute, state_costs_of

__all__ = ["base_lists", "cached_floor", "grid_floor", "grid_work", "group_floor",
           "group_params", "least_floor", "least_priced", "line_floor", "line_work",
           "state_floor", "state_work"]


def grid_floor(lt, state, b: int, ctx, work: float | None = None) -> float:
    """Seconds that ``state_cost(lt, state, b, ctx).time`` is never under, for a state of a
    multi-dimensional tensor mode (``state.mode.name`` is not 1D, its size t > 1).

    Proof, term by term of `cost.model.state_cost` (time = forward + backward + recompute +
    comm). forward = GEMMs + attention + memory-bound + fp8 casts, backward = 2 (forward -
    forward casts) + backward casts + the chunked loss's remade logits, recompute >= 0:
    time >= 3 (GEMMs + memory-bound) + comm. Under a grid mode every GEMM is split t ways
    and over cp's c ranks (`_gemms_floor`). The memory-bound ops take ``max(mem_roof, ...)``
    with ``mem_roof`` the layer's traffic / (t c) over the memory bandwidth (left out under
    compile, whose fused share is smaller). comm: the grid's GEMM collectives as
    `state_cost` prices them (`cost.model.grid_comm`, memoised in the Context, which the
    pricing then reads back), and cp's around attention at least `cost.cp.context_floor`;
    fp8's amaxes and the experts' all-to-alls only add. ``work``: its `grid_work`, where
    read already."""
    mode = state.mode
    if work is None:
        work = grid_work(lt, state, b, ctx)
    return work + grid_comm(lt, mode, b, ctx, state.recompute ==
                                                     FULL)[0] + context_floor(lt, mode, b, ctx)


def grid_work(lt, state, b: int, ctx) -> float:
    """`grid_floor`'s 3 (GEMMs + memory-bound) alone: never over it (the collectives' seconds
    it adds are >= 0, and adding them rounds to no less), read without pricing a
    collective."""
    hw, mode = ctx.hw, state.mode
    t, c = mode.size, ctx.cp.size
    gemms = _gemms_floor(lt, [True] * len(lt.gemms), t, c * mode.batch_split, b, ctx)
    mem = 0.0 if ctx.compile else memory_time(lt.traffic(b) / t / c, hw)
    return 3 * (gemms + mem)


def line_floor(lt, state, b: int, ctx, work: float | None = None) -> float:
    """Seconds that ``state_cost(lt, state, b, ctx).time`` is never under, for a state of
    1D tensor parallelism (of any size t, 1 included).

    Proof, term by term of `cost.model.state_cost` as in `grid_floor`, with attention:
    time >= 3 (GEMMs + attention + memory-bound) + comm. A GEMM the catalog splits
    (``Sharded.gemm_split``) is split t ways and over cp, the others over cp alone
    (`_gemms_floor`). Each fused attention core runs `attention_time` of its FLOPs over its
    parts with as many keys as it likes (``keys = inf``: the kernel's fill is at most 1 at
    any finite number) and no causal imbalance (>= 1): the least its price can be (an
    unfused core's left out). The memory-bound ops take at least the layer's 1D traffic
    (split values / t, replicated ones / t under Megatron-SP) over the memory bandwidth
    (left out under compile). comm: the layout's tensor-parallel collectives as
    `state_cost` prices them (`Context.coll`, memoised), each run at least once, and cp's
    around attention at least `cost.cp.context_floor`; fp8's amaxes and the experts'
    all-to-alls only add. ``work``: its `line_work`, where read already."""
    mode = state.mode
    t, c = mode.size, ctx.cp.size
    sharded = lt.sharded[t]
    sp = state.sp == MEGATRON_SP and t > 1
    if work is None:
        work = line_work(lt, state, b, ctx)
    comm = 0.0
    if t > 1:
        for op, _, nbytes in sharded.comm + (sharded.expert_comm if c == 1 else []):
            n = nbytes(b) / c
            if sp and op == "all_reduce" and lt.is_block:
                comm += ctx.coll("reduce_scatter", n, ctx.tp) + ctx.coll("all_gather", n, ctx.tp)
            else:
                comm += ctx.coll(op, n, ctx.tp)
    return work + comm + context_floor(lt, mode, b, ctx)


def line_work(lt, state, b: int, ctx) -> float:
    """`line_floor`'s 3 (GEMMs + attention + memory-bound) alone: never over it (the
    collectives' seconds it adds are >= 0, and adding them rounds to no less), read without
    pricing a collective: from the layer, the state's tensor size and sequence split, the
    micro-batch and the Context's device, dtype, attention kernel, compile and cp size."""
    hw, mode = ctx.hw, state.mode
    t, c = mode.size, ctx.cp.size
    sharded = lt.sharded[t]
    sp = state.sp == MEGATRON_SP and t > 1
    gemms = _gemms_floor(lt, sharded.gemm_split, t, c, b, ctx)
    dtype = fp8.compute_dtype(ctx.dtype)
    attention = 0.0
    for a, split in zip(lt.attention if ctx.attention_kernel != "unfused" else (),
                        sharded.attention_split):
        attention += attention_time(a.flops(b) / ((t if split else 1) * c), math.inf,
                                    a.causal, hw, dtype, ctx.attention_kernel)
    mem = 0.0
    if not ctx.compile:
        traffic = sharded.traffic_split(b) + sharded.traffic_replicated(b) / (t if sp else 1)
        mem = memory_time(traffic / c, hw)
    return 3 * (gemms + attention + mem)


def state_work(lt, state, b: int, ctx) -> float:
    """`line_work` or `grid_work`: a lower bound of `state_floor` with no collective in it."""
    if state.mode.name == TP_1D:
        return line_work(lt, state, b, ctx)
    return grid_work(lt, state, b, ctx)


def state_floor(lt, state, b: int, ctx, work: float | None = None) -> float:
    """`line_floor` or `grid_floor`, as the state's tensor mode asks (``work``: its
    `state_work`, where read already)."""
    if state.mode.name == TP_1D:
        return line_floor(lt, state, b, ctx, work)
    return grid_floor(lt, state, b, ctx, work)


def _gemms_floor(lt, split, t: int, rows: int, b: int, ctx) -> float:
    """Seconds of the layer's GEMMs (experts' aside) that `cost.model` never prices under:
    a GEMM split t ways (``split``) and over cp's c ranks runs ``f`` FLOPs; outside fp8 at
    exactly its price (`gemm_time` of its local shape, ``rows`` ways over tokens, with its
    operand traffic); under fp8 at the efficiency curve ``e f / (f + h)`` <= ``e`` of the
    fastest peak it may run at, ``(f + h) / (peak e)`` seconds (traffic and floor only add)."""
    hw, c = ctx.hw, ctx.cp.size
    dtype = fp8.compute_dtype(ctx.dtype)
    under_fp8 = ctx.dtype == FP8
    if under_fp8:
        rate = max(hw.flops(dtype), float(hw.peak_flops.get(FP8, 0.0))) * hw.gemm_efficiency
    itemsize = ITEMSIZE.get(dtype, 4)
    out = 0.0
    for g, cut in zip(lt.gemms, split):
        if g.expert:
            continue
        parts = t if cut else 1
        f = g.flops(b) / (parts * c)
        if f <= 0:
            continue
        if under_fp8:
            out += (f + hw.gemm_half_flops) / rate
        else:
            out += gemm_time(f, hw, dtype, local_gemm_shape(
                g, b, parts * c // rows if g.weight else 1, rows if g.weight else parts * c),
                itemsize)
    return out


def group_floor(search, kinds, b: int, ctx, work: bool = False,
                had: list | None = None) -> tuple[float, float]:
    """Lower bounds of the ``min_total`` and ``min_single`` of the Prepared of ``kinds`` at
    micro-batch ``b`` under ``ctx``, read before a search makes it: each kind at the least
    `state_floor` of its states with the least recomputation per layout, whose least seconds
    every Prepared's ``least`` is, with or without a base (`least_states`), from the layers'
    sizes and collectives alone; with `work`, at the least `state_work` instead (lower still,
    and the same for the groups of one state list, micro-batch and cp size, which share it).
    ``had``: a grid search's `base_lists` of ``kinds``, where its base (1D) search's lists
    begin these: each kind's least over the base's states is then read from what the
    searches sharing these caches found for those lists (`_kind_floors`), beside the least
    over the layouts past them (`_new_works`); the same minimum over the same states."""
    if work:
        key = ("work floor", id(kinds), b, ctx.cp.size)
        hit = search._cost_cache.get(key)
        if hit is None:
            hit = search._cost_cache[key] = _sums(search, kinds, _with_new(
                search, kinds, b, ctx, True, had))
        return hit
    return _sums(search, kinds, _with_new(search, kinds, b, ctx, False, had))


def _with_new(search, kinds, b: int, ctx, work: bool, had) -> list[float]:
    """`group_floor`'s least seconds of each kind (`state_work` with `work`, else
    `state_floor`): `_kind_floors` of ``kinds``, or of ``had`` beside the layouts past it."""
    if had is None:
        return _kind_floors(search, kinds, b, ctx, work, search._base is None)
    out = list(_kind_floors(search, had, b, ctx, work, True))
    for t, ((lt, states), (_, old)) in enumerate(zip(kinds, had)):
        if len(states) > len(old):
            works = _new_works(search, lt, states, len(old), b, ctx)
            out[t] = min(out[t], works[0][0]) if work else \
                _least_floor_of(search, lt, works, b, ctx, out[t])
    return out


def _kind_floors(search, kinds, b: int, ctx, work: bool, shared: bool) -> list[float]:
    """Per kind of ``kinds`` (one of `Space.kinds`' lists), the least `state_work` (with
    `work`) or `state_floor` of its states with the least recomputation per layout: once
    per list, micro-batch and cp size (`state_work`) or Context, for every search sharing
    these caches where the list is `shared`, a search's with no base (the base lists its
    grid searches read), else in the search's own (a grid search's lists go with it, and
    the shared caches key lists by identity)."""
    table = search._shared if shared else search._cost_cache
    key = ("kind floors", id(kinds), b, ctx.cp.size if work else id(ctx))
    hit = table.get(key)
    if hit is None:
        works = _works(search, table, kinds, b, ctx)
        hit = table[key] = [w[0][0] for w in works] if work else [
            _least_floor_of(search, lt, ws, b, ctx) for (lt, _), ws in zip(kinds, works)]
    return hit


def base_lists(search, mesh, b: int, kinds) -> list | None:
    """The base (1D) search's `Space.kinds` of a grid search's ``kinds`` (the same tensor
    size, micro-batch and cp), where each of its state lists begins the grid's list of the
    same kind (`Search._base_of`'s test); else None. Once per list and search."""
    if search._base is None:
        return None
    key = ("base lists", id(kinds))
    if key not in search._cost_cache:
        had = search._base.space.kinds(mesh[TP], b, mesh[CP] > 1)
        search._cost_cache[key] = had if had is not None and all(
            states[:len(old)] == old for (_, states), (_, old) in zip(kinds, had)) else None
    return search._cost_cache[key]


def _works(search, table: dict, kinds, b: int, ctx) -> list:
    """Per kind, `_sorted_works` of its states: once per state list, micro-batch and cp
    size in ``table`` (its Contexts share the device, dtype, kernel and compile)."""
    key = ("works", id(kinds), b, ctx.cp.size)
    hit = table.get(key)
    if hit is None:
        hit = table[key] = [_sorted_works(lt, states, which, b, ctx) for (lt, states), which
                            in zip(kinds, _least_of(search, kinds))]
    return hit


def _new_works(search, lt, states, n: int, b: int, ctx) -> list:
    """`_sorted_works` of the states of ``states`` in the layouts of its states past the
    first ``n`` (once per list, micro-batch and cp size in a search)."""
    key = ("new works", id(states), n, b, ctx.cp.size)
    hit = search._cost_cache.get(key)
    if hit is None:
        known = ("new states", id(states), n)  # (the same for every micro-batch and cp size)
        new = search._cost_cache.get(known)
        if new is None:
            layouts = {s.layout for s in states[n:]}
            new = [s for s in states if s.layout in layouts]
            new = search._cost_cache[known] = (new, least_recompute(new))
        hit = search._cost_cache[key] = _sorted_works(lt, *new, b, ctx)
    return hit


def _sorted_works(lt, states, which, b: int, ctx) -> list:
    """(`state_work`, place, state) of the states of ``states`` at the indices ``which``
    (each layout's state with the least recomputation, `least_recompute`), least work
    first."""
    return sorted((state_work(lt, states[k], b, ctx), n, states[k]) for n, k in enumerate(which))


def _sums(search, kinds, fastest) -> tuple[float, float]:
    """(the chain's sum of its kinds' seconds ``fastest``, the most of them it holds)."""
    key = ("kind counts", len(kinds))
    hit = search._cost_cache.get(key)
    if hit is None:  # (the chain's layers per kind, and the kinds it holds: once a search)
        order = search.chain.order
        hit = search._cost_cache[key] = (np.bincount(order, minlength=len(kinds)),
                                         list(dict.fromkeys(order)))
    counts, present = hit
    return float(np.dot(counts, fastest)), max(fastest[t] for t in present)


def group_params(search, kinds, ctx) -> float:
    """The ``min_params - min_experts`` of the Prepared of ``kinds`` under ``ctx`` of a search
    with no base, to the bit, before it makes it (`state_params`: the same values as its
    states' costs, summed alike)."""
    params, experts = [], []
    for (lt, states), which in zip(kinds, _least_of(search, kinds)):
        held = [state_params(lt, states[k], ctx) for k in which]
        params.append(min(p for p, _ in held))
        experts.append(min(e for _, e in held))
    counts = np.bincount(search.chain.order, minlength=len(kinds))
    return float(np.dot(counts, params)) - float(np.dot(counts, experts))


def _least_floor_of(search, lt, works, b: int, ctx, least: float = math.inf) -> float:
    """The least of ``least`` and the `state_floor` of the states of ``works``
    (`_sorted_works`' of one kind), to the bit, reading a state's floor (its collectives
    priced) only where its `state_work` is under the least floor found so far, in the order
    of their work: a state left out has a floor of at least its work, at least that least,
    so the minimum (exact in any order) is the one of every state's floor."""
    for work, _, state in works:
        if work >= least:
            break
        least = min(least, cached_floor(search, lt, state, b, ctx, work))
    return least


def _least_of(search, kinds) -> list:
    """`least_recompute` of each kind's states, once per state list (`Space.kinds`' lists
    are one object per tensor size, micro-batch and cp) and search."""
    key = ("least recompute", id(kinds))
    hit = search._cost_cache.get(key)
    if hit is None:
        hit = search._cost_cache[key] = [least_recompute(states) for _, states in kinds]
    return hit


def cached_floor(search, lt, state, b: int, ctx, work: float | None = None) -> float:
    """`state_floor` (``work``: its `state_work`, where read already), once per layer kind,
    state, micro-batch and Context for every search sharing `search`'s caches (an executable
    search's grid searches read the 1D states' floors its 1D search found). Keyed by
    identity: the kinds are the chain's, each state value one object (`space._state`) and
    each Context one per placement in those caches."""
    table = search._shared.get("state floors")
    if table is None:
        table = search._shared["state floors"] = {}
    key = (id(lt), id(state), b, id(ctx))
    hit = table.get(key)
    if hit is None:
        hit = table[key] = state_floor(lt, state, b, ctx, work)
    return hit


def _per_kind(kinds, base, which, least_of) -> list[float] | None:
    """Each kind's least seconds, in order: the base's where its states are the base's
    (``which``'s index is None), else `least_of(t, layer_type, states, idx, joined)`; None as
    soon as that gives None."""
    fastest = []
    for t, (idx, joined) in enumerate(which):
        if idx is None:
            fastest.append(base.least[t][0])
            continue
        lt, states = kinds[t]
        least = least_of(t, lt, states, idx, joined)
        if least is None:
            return None
        fastest.append(least)
    return fastest


def least_floor(search, kinds, b: int, context, base, which) -> tuple[float, float] | None:
    """A lower bound of `prepared.least_total` (the same arguments; ``which``: its
    `least_states`) priced only where `least_total` reads what is priced already: a kind
    whose states are the base's keeps the base's least seconds, a kind whose states to price
    are all of a grid mode takes the least `grid_floor` of them (beside the base's least
    seconds where those join); None where a kind has a 1D state to price. With it, a lower
    bound of the Prepared's ``min_single`` (the most of its kinds' least seconds, over the
    kinds the chain holds): the most of the same per-kind bounds."""
    ctx = context[0]

    def bound(t, lt, states, idx, joined):
        if any(states[k].mode.name == TP_1D for k in idx):
            return None
        floor = min(cached_floor(search, lt, states[k], b, ctx) for k in idx)
        return min(base.least[t][0], floor) if joined else floor

    fastest = _per_kind(kinds, base, which, bound)
    if fastest is None:
        return None
    counts = base.counts if base else np.bincount(search.chain.order, minlength=len(kinds))
    present = base.present if base else dict.fromkeys(search.chain.order)
    return float(np.dot(counts, fastest)), max(fastest[t] for t in present)


def least_priced(search, kinds, b: int, context, base, which) -> float:
    """`prepared.least_total` (the same arguments; ``which``: its `least_states`), to the bit,
    pricing of each kind's grid states only those whose `grid_floor` is under the least
    seconds found so far: a kind's states go in the order of their floors (1D states, which
    have none, first), beginning from the base's least seconds where those join, and stop at
    the first floor that is not under it. Exact: every state left unpriced has seconds at
    least its floor, which is at least the least seconds already found, so the minimum
    (exact in floating point, whatever the order) is the one of every state; the sum is then
    `least_total`'s, over the same values in the same order."""
    ctx = context[0]

    def priced(t, lt, states, idx, joined):
        least = base.least[t][0] if joined else float("inf")
        floors = sorted((-float("inf") if states[k].mode.name == TP_1D else
                         cached_floor(search, lt, states[k], b, ctx), n, k) for n, k in enumerate(idx))
        for floor, _, k in floors:
            if floor >= least:
                break
            least = min(least, state_costs_of(lt, [states[k]], b, *context)[0].time)
        return least

    fastest = _per_kind(kinds, base, which, priced)
    counts = base.counts if base else np.bincount(search.chain.order, minlength=len(kinds))
    return float(np.dot(counts, fastest))
