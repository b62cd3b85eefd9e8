"""Context parallelism's communication around attention (`context_comm`): Ulysses'
all-to-alls and ring attention's hops, what compute hides of them and what it loses to
them, per layer and micro-batch; and the least of it any state pays (`context_floor`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cost.hardware import Hardware
from autopar.cost.layer import LayerType
from autopar.modes import RING, TP_1D

__all__ = ["CpCost", "contention_s", "context_comm", "context_floor", "ring_exposed"]


@dataclass(frozen=True)
class CpCost:
    """Context parallelism around one layer's attention, per micro-batch."""

    exposed: float  # seconds of communication compute does not hide
    contention: float  # seconds compute loses to the collectives it overlaps
    nbytes: float  # bytes this rank sends
    workspace: float = 0.0  # bytes of receive buffers held while attention runs


def ring_exposed(c: int, hop: float, pair: float, step_f: float, step_b: float,
                 rerun: bool) -> tuple[float, float]:
    """(exposed, overlapped) seconds of ring attention's hops over ``c`` ranks.

    Forward: c - 1 K/V hops; the first is waited for, each later one overlaps only the
    attention step before it (``step_f``, one block of keys). Backward: the K/V go round
    again and the K/V gradients make c hops, the last one home after the last step: the
    first K/V hop and that return are exposed, c - 2 steps carry a K/V and a gradient block
    together (``pair`` seconds) and one step the last gradient hop alone. ``rerun``: the
    forward runs again for recomputation."""
    if c <= 1:
        return 0.0, 0.0
    fwd_exposed = hop + (c - 2) * max(0.0, hop - step_f)
    fwd_hidden = (c - 2) * min(hop, step_f)
    bwd_exposed = 2 * hop + (c - 2) * max(0.0, pair - step_b) + max(0.0, hop - step_b)
    bwd_hidden = (c - 2) * min(pair, step_b) + min(hop, step_b)
    runs = 2 if rerun else 1
    return runs * fwd_exposed + bwd_exposed, runs * fwd_hidden + bwd_hidden


def contention_s(overlapped: float, hw: Hardware) -> float:
    """Seconds compute loses while collectives overlap it for ``overlapped`` seconds: their
    kernels hold ``comm_sm_share`` of the SMs, so that compute runs 1 / (1 - share) slower."""
    share = hw.comm_sm_share
    return overlapped * share / (1 - share) if 0 < share < 1 else 0.0


def context_comm(lt: LayerType, mode, batch: float, ctx,
                 attn_each: list[float], rerun: bool) -> CpCost:
    """Sequence (context) parallelism over cp around each attention core, as
    ``autopar.kernels.sequence`` runs it.

    Ulysses (Jacobs et al. 2023, arXiv 2309.14509): all-to-alls of q, k, v in and of the
    output back, forward, and of their gradients backward, each on this rank's block; key
    and value heads are repeated f = c / gcd(kv heads, c) times first when there are fewer
    of them than ranks. Ring attention (Li et al. 2021, arXiv 2105.13120): the key and value
    blocks travel c-1 hops forward and c-1 again backward, and the key and value gradients
    c hops (the last one home), each hop hidden only behind the one attention step it runs
    beside (:func:`ring_exposed`); the ranks hold a receive buffer for the next K/V block
    and one for the travelling gradients.
    """
    c = ctx.cp.size
    exposed = hidden = nbytes = workspace = 0.0
    if c <= 1:
        return CpCost(0.0, 0.0, 0.0)
    for attn, (kv, buffers) in zip(attn_each, _blocks(lt, mode, batch, c)):
        if ctx.cp_mode == RING:
            hop, pair = ctx.coll("p2p", kv, ctx.cp), ctx.coll("p2p", 2 * kv, ctx.cp)
            e, h = ring_exposed(c, hop, pair, attn / c, 2 * attn / c, rerun)
            exposed += e
            hidden += h
            nbytes += (3 * c - 2) * kv
            workspace = max(workspace, 2 * kv)
        else:
            sec = 2 * sum(ctx.coll("all_to_all", n, ctx.cp) for n in buffers)
            exposed += sec * (1.5 if rerun else 1)
            nbytes += 2 * sum(buffers) * (c - 1) / c
    return CpCost(exposed, contention_s(hidden, ctx.hw), nbytes, workspace)


def context_floor(lt: LayerType, mode, batch: float, ctx) -> float:
    """Seconds of `context_comm`'s ``exposed + contention`` that no state of ``mode`` is
    under, whatever its attention takes: ring attention's first forward hop and the
    backward's first K/V hop and return (`ring_exposed`: 3 hops at least, each of the
    others exposed by >= 0), Ulysses' all-to-alls run once; contention >= 0."""
    c = ctx.cp.size
    if c <= 1:
        return 0.0
    out = 0.0
    for kv, buffers in _blocks(lt, mode, batch, c):
        if ctx.cp_mode == RING:
            out += 3 * ctx.coll("p2p", kv, ctx.cp)
        else:
            out += 2 * sum(ctx.coll("all_to_all", n, ctx.cp) for n in buffers)
    return out


def _blocks(lt: LayerType, mode, batch: float, c: int):
    """Per attention core, this rank's block as cp moves it: (bytes of its keys and values,
    Ulysses' buffers: q, output, k, v)."""
    act = lt.boundary(batch) / (mode.size * c)
    for a in lt.attention:
        # 1D splits the heads over tp; a 2D, 2.5D or 3D grid over one side of q ranks
        split = mode.size if mode.name == TP_1D else mode.q
        kv_heads = max(1, a.kv_heads // split)
        heads = max(1, a.heads // split)
        kv = 2 * act * kv_heads / heads
        f = c // math.gcd(kv_heads, c)
        yield kv, (act, act, f * kv / 2, f * kv / 2)
