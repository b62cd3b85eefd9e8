"""Lower bounds on a multi-dimensional (2D, 2.5D, 3D) layer state's seconds, read from the
layer's sizes and the device's rates alone, without pricing the state (`cost.model`): an
executable search's grid search asks them before it prices a grid's states for a bound
(`least_floor`), and skips the (mesh, micro-batch) groups they already put past the k best.
"""

from __future__ import annotations

import numpy as np

from autopar.cost import fp8
from autopar.cost.comm import grid_gemm_bytes
from autopar.cost.model import memory_time
from autopar.modes import FP8, TP_1D, TP_2D, TP_25D
from autopar.search.prepared import state_costs_of

__all__ = ["grid_floor", "least_floor", "least_priced"]


def grid_floor(lt, state, b: int, ctx) -> float:
    """Seconds that ``state_cost(lt, state, b, ctx).time`` is never under, for a state of a
    multi-dimensional tensor mode (``state.mode.name`` is not 1D, its size t > 1).

    Proof, term by term of `cost.model.state_cost` (time = forward + backward + recompute +
    comm). Under a grid mode every GEMM is split t ways and over cp's c ranks, so one runs
    ``f = flops / (t c)`` at ``_gemm_s``'s efficiency ``e f / (f + h)`` <= ``e``
    (``gemm_efficiency``, ``gemm_half_flops``): at least ``(f + h) / (peak e)`` seconds,
    peak being the compute dtype's FLOP/s (or fp8's, the faster, under fp8); the operand
    traffic and the kernel floor only add. The memory-bound ops take ``max(mem_roof, ...)``
    with ``mem_roof`` the layer's traffic / (t c) over the memory bandwidth (left out under
    compile, whose fused share is smaller). forward = GEMMs + attention + memory-bound +
    fp8 casts, backward = 2 (forward - forward casts) + backward casts + the chunked loss's
    remade logits, recompute >= 0: time >= 3 (GEMMs + memory-bound). comm: the grid's GEMM
    collectives (`cost.model._multi_d_comm`) move, per weight GEMM, all-gathers of
    ``v q / (q - 1)`` bytes over q ranks for each volume v (forward at least once, backward
    once), and every all-gather algorithm (`cost.comm`: ring, doubling, hierarchical) moves
    (q - 1)/q of its bytes at a per-byte time no less than the intra-node link's
    (1 / intra_node_bandwidth; the inter-node betas are 1 / min(that, ...)), plus latencies
    >= 0: at least v / intra_node_bandwidth each. 2.5D's depth all-reduce, cp's ring, fp8's
    amaxes and the experts' all-to-alls only add. The collectives' floor is left out where the
    profile carries fitted all-gather figures (`Hardware.collectives`), where a Context
    names its own groups (``tp_groups``), or where a latency is negative."""
    hw, mode = ctx.hw, state.mode
    t, c = mode.size, ctx.cp.size
    peak = hw.flops(fp8.compute_dtype(ctx.dtype))
    if ctx.dtype == FP8:
        peak = max(peak, float(hw.peak_flops.get(FP8, 0.0)))
    rate, half = peak * hw.gemm_efficiency, hw.gemm_half_flops
    gemms = 0.0
    for g in lt.gemms:
        if not g.expert:
            f = g.flops(b) / (t * c)
            if f > 0:
                gemms += (f + half) / rate
    mem = 0.0 if ctx.compile else memory_time(lt.traffic(b) / t / c, hw)
    return 3 * (gemms + mem) + _comm_floor(lt, mode, b / c, ctx)


def _comm_floor(lt, mode, batch: float, ctx) -> float:
    """The grid's GEMM all-gathers at the intra-node link's bandwidth, latencies left out
    (`grid_floor`'s proof); 0 where that proof does not hold."""
    hw = ctx.hw
    if (hw.collectives and "all_gather" in hw.collectives) or ctx.tp_groups or \
            hw.intra_node_latency < 0 or hw.inter_node_latency < 0:
        return 0.0
    q, d = mode.q, mode.d
    volume = 0.0
    for mk, kn, mn in grid_gemm_bytes(lt, batch):
        if mode.name == TP_2D:
            volume += 3 * (q - 1) * (mk + kn) / q ** 2  # forward, backward twice as much
        elif mode.name == TP_25D:
            volume += 3 * (q - 1) * (mk / d + kn) / q ** 2
        else:
            volume += 2 * (q - 1) * (mk + kn + mn) / q ** 3
    return volume / hw.intra_node_bandwidth


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
        floor = min(grid_floor(lt, states[k], b, ctx) for k in idx)
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
                         grid_floor(lt, states[k], b, ctx), n, k) for n, k in enumerate(idx))
        for floor, _, k in floors:
            if floor >= least:
                break
            least = min(least, state_costs_of(lt, [states[k]], b, *context)[0].time)
        return least

    fastest = _per_kind(kinds, base, which, priced)
    counts = base.counts if base else np.bincount(search.chain.order, minlength=len(kinds))
    return float(np.dot(counts, fastest))
