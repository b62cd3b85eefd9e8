"""Attention split by heads or batch (no communication), or on the sequence over cp:
ring attention (Li et al. 2021) or Ulysses (Jacobs et al. 2023)."""

from __future__ import annotations

import math

import sympy
import torch
import torch.fx as fx

from autopar.errors import PlanError
from autopar.graph.analysis import OpKind, node_label
from autopar.graph.masks import is_causal_mask, too_large
from autopar.modes import CP, RING, ULYSSES
from autopar.sharding.layout import Layout, Shard, divisible
from autopar.sharding.rules.context import (
    RuleContext,
    itemsize,
    out_layouts,
    rep,
    replicate,
    shard_dim,
    splits,
)
from autopar.sharding.rules.registry import decides
from autopar.sharding.strategy import CommOp, Need, Rewrite, Strategy

aten = torch.ops.aten


@decides(OpKind.ATTENTION)
def attention(ctx: RuleContext) -> Strategy:
    """Split by heads (dim 1) or by batch (dim 0): each rank attends with whole heads of
    whole sequences, no communication."""
    q, k, v = ctx.node.args[:3]
    mask = ctx.node.args[3] if len(ctx.node.args) > 3 else ctx.node.kwargs.get("attn_mask")
    dims = [shard_dim(ctx, n) for n in (q, k, v)]
    if ctx.axis == CP and any(d == 2 for d in dims):
        return sequence_attention(ctx, q, k, v, mask)
    d = next((d for d in dims if d in (0, 1)), None)
    if d is None or not all(splits(ctx.shape(n)[d], ctx.size) for n in (q, k, v)):
        return replicate(ctx)
    needs = {n: Need(rep(n).with_shard(d, ctx.axis)) for n in (q, k, v)}
    if isinstance(mask, fx.Node):
        mshape = ctx.shape(mask)
        split_mask = len(mshape) == 4 and mshape[d] != 1
        needs[mask] = Need(rep(mask).with_shard(d, ctx.axis) if split_mask else rep(mask))
    out = Layout.replicated(len(ctx.info.shape)).with_shard(d, ctx.axis)
    return Strategy("heads" if d == 1 else "batch", needs, out)


_SDPA_ARGS = {  # target -> positions of (attn_mask, dropout_p, is_causal, scale, enable_gqa)
    aten.scaled_dot_product_attention.default: (3, 4, 5, 6, 7),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (None, 3, 4, None, None),
}


def _arg(node: fx.Node, pos, name: str, default):
    if pos is not None and len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def repeated_kv(node: fx.Node) -> fx.Node | None:
    """The [B, Hkv, S, D] source of a key or value repeated to the query heads the way
    transformers' `repeat_kv` does it (x[:, :, None].expand(B, Hkv, n, S, D).reshape(B,
    Hkv*n, S, D): head j reads kv head j // n, as `enable_gqa`), or None."""
    if not isinstance(node, fx.Node) or node.target not in _RESHAPES:
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or expand.target is not aten.expand.default:
        return None
    unsq = expand.args[0]
    if not isinstance(unsq, fx.Node) or unsq.target is not aten.unsqueeze.default or \
            unsq.args[1] % 5 != 2:
        return None
    src = unsq.args[0]
    shapes = [n.meta["autopar"].shape if n.meta.get("autopar") else None
              for n in (src, expand, node)]
    if any(sh is None for sh in shapes) or [len(sh) for sh in shapes] != [4, 5, 4]:
        return None
    (b, hkv, seq, d), (b2, hkv2, n, seq2, d2), out = shapes
    if (b2, hkv2, seq2, d2) != (b, hkv, seq, d) or tuple(out) != (b, hkv * n, seq, d):
        return None
    return src


def _only_cp_split(layout) -> bool:
    return isinstance(layout, Layout) and not layout.partial and \
        layout.shards == (Shard(2, CP),)


def sequence_attention(ctx: RuleContext, q, k, v, mask) -> Strategy:
    """q, k, v split on the sequence dim (2) over `cp`: ring attention or Ulysses
    (`autopar.kernels.sequence`), with the collectives the kernel logs. Dropout and masks
    other than is_causal (or a mask equal to it, `autopar.graph.masks`) are not supported:
    the sequence is gathered instead. k, v of one head broadcast over the query heads
    (multi-query attention, as torch's SDPA); k, v repeated to the query heads by
    `repeat_kv` reach the kernel as their sources when cp alone splits them."""
    node = ctx.node
    positions = _SDPA_ARGS.get(node.target)
    mode = ctx.sequence_mode or RING
    if positions is None:
        return replicate(ctx, note=f"{node.target} has no sequence-parallel kernel; ran with "
                                   "the sequence gathered")
    scale, gqa, dropout_p, causal, mask = _sdpa_options(node, positions, mask)
    if isinstance(mask, fx.Node) and not causal and len(ctx.shape(q)) == 4 and \
            ctx.shape(q)[2] == ctx.shape(k)[2] and is_causal_mask(mask):
        causal, mask = True, None  # a causal mask built from positions (transformers' models)
    if isinstance(mask, fx.Node) and too_large(mask):
        return replicate(ctx, note=f"the attention mask of {node_label(node)} is too large to "
                                   "check for causality; runs with the sequence gathered (pass "
                                   "is_causal=True instead of a causal mask)")
    if isinstance(mask, fx.Node) or dropout_p:
        return replicate(ctx, note="sequence-parallel attention takes no mask or dropout; "
                                   "runs with the sequence gathered")
    c = ctx.size
    shapes = [ctx.shape(n) for n in (q, k, v)]
    if not all(divisible(sh[2], c) for sh in shapes):
        return replicate(ctx)
    full = ctx.all_layouts
    sizes = ctx.sizes

    others = _other_splits(full, sizes, (q, k, v), shapes)
    other = others[0] if others else None

    def per_rank(n: fx.Node) -> tuple[sympy.Expr, int]:
        """Bytes of this rank's block of n (every axis's split) and its heads per rank."""
        lay = rep(n).with_shard(2, CP)
        heads = int(ctx.shape(n)[1])
        for split in others:
            lay = lay.with_shard(split.dim, split.axis)
            heads //= sizes[split.axis] if split.dim == 1 else 1
        return ctx.local_bytes(n, lay), heads

    # k, v repeated to the query heads (transformers' repeat_kv) with the sequence split
    # alone: the kernel takes their sources with enable_gqa, so ring attention sends Hkv
    # heads, not H, and Ulysses repeats only as far as its head split needs
    sources = _kv_sources(full, sizes, k, v) if other is None else None
    if sources is not None:
        k, v = sources
        gqa = True
    (qb, h), (kb, hkv), (vb, _) = (per_rank(n) for n in (q, k, v))
    ob = qb * sympy.sympify(ctx.shape(v)[3]) / sympy.sympify(ctx.shape(q)[3])
    grads = [bool(ctx.requires_grad.get(n)) for n in (q, k, v)]
    backward = ctx.requires_grad.get(node, any(grads))
    if mode == ULYSSES:
        if h % c:
            per_rank_note = " per tensor rank" if h != int(shapes[0][1]) else ""
            raise PlanError(f"Ulysses splits the {h} attention heads{per_rank_note} "
                            f"of {ctx.info.module or ctx.info.layer} over sequence size {c}, and "
                            f"{h} does not divide by {c}; use mode='ring', or a sequence size "
                            f"that divides {h}.")
        comm = _ulysses_comm(node.name, c // math.gcd(hkv, c), (qb, kb, vb), ob, grads, backward)
    elif c > 1:
        comm = _ring_comm(node.name, c, kb + vb, k, grads, backward)
    else:
        comm = []
    needs = {n: Need(rep(n).with_shard(2, CP)) for n in ctx.node.args[:3]}
    out = out_layouts(ctx, lambda shape: Layout.replicated(len(shape)).with_shard(2, CP)
                       if len(shape) == 4 else Layout.replicated(len(shape)))
    return Strategy("sequence", needs, out, comm=comm, rewrite=Rewrite.SEQUENCE_ATTENTION,
                    args={"sequence": {"mode": mode, "is_causal": causal, "scale": scale,
                                       "enable_gqa": gqa,
                                       "repeated_kv": sources is not None}})

def _sdpa_options(node: fx.Node, positions: tuple, mask) -> tuple:
    """An SDPA node's scale, enable_gqa, dropout_p, is_causal and mask (`mask` as the rule
    found it, but for the CPU flash kernel, which takes it as a keyword)."""
    _, pd, pc, ps, pg = positions
    if node.target is aten._scaled_dot_product_flash_attention_for_cpu.default:
        mask = node.kwargs.get("attn_mask")
        scale = node.kwargs.get("scale")
        gqa = False
    else:
        scale = _arg(node, ps, "scale", None)
        gqa = bool(_arg(node, pg, "enable_gqa", False))
    return scale, gqa, _arg(node, pd, "dropout_p", 0.0), bool(_arg(node, pc, "is_causal", False)), \
        mask


def _kv_sources(full: dict, sizes: dict, k: fx.Node, v: fx.Node) -> list | None:
    """k and v's sources before transformers' repeat_kv, when cp alone splits them all."""
    sources = [repeated_kv(n) for n in (k, v)]
    if all(sources) and all(size == 1 for axis, size in sizes.items() if axis != CP) and \
            all(_only_cp_split(full.get(n)) for n in (k, v, *sources)):
        return sources
    return None


def _other_splits(full: dict, sizes: dict, qkv: tuple, shapes: list) -> list[Shard]:
    """The splits the other axes' attention rules put on batch and heads (a 2D grid splits
    both), one per dim; those that do not divide every one of q, k, v are left out."""
    out: list[Shard] = []
    found = [s for n in qkv for s in (full[n].shards if isinstance(full.get(n), Layout) else ())]
    for s in found:
        if s.axis != CP and s.dim in (0, 1) and s.groups == 1 and \
                all(t.dim != s.dim for t in out) and \
                all(splits(sh[s.dim], sizes[s.axis]) for sh in shapes):
            out.append(s)
    return out


def _ulysses_comm(name: str, f: int, qkv_bytes: tuple, ob, grads: list[bool],
                  backward: bool) -> list[CommOp]:
    """Ulysses' all-to-alls: q, k and v (k and v repeated `f` times to the head split) and
    the output forward; the output's gradient and those of the inputs that need one
    backward."""
    qb, kb, vb = qkv_bytes
    comm = [CommOp("all_to_all", CP, "forward", b, name) for b in (qb, f * kb, f * vb, ob)]
    if backward:
        comm.append(CommOp("all_to_all", CP, "backward", ob, name))
        for b, g in zip((qb, f * kb, f * vb), grads):
            if g:
                comm.append(CommOp("all_to_all", CP, "backward", b, name))
    return comm


def _ring_comm(name: str, c: int, kv, k: fx.Node, grads: list[bool],
               backward: bool) -> list[CommOp]:
    """Ring attention's sends: the k, v block `c` - 1 times forward and backward, and the
    dk, dv accumulators (float32 for 16-bit inputs) `c` times backward."""
    comm = [CommOp("p2p", CP, "forward", kv, name) for _ in range(c - 1)]
    if backward:
        comm += [CommOp("p2p", CP, "backward", kv, name) for _ in range(c - 1)]
        if grads[1] or grads[2]:
            item = itemsize(k.meta["autopar"].dtype)
            acc = kv * sympy.Rational(max(4, item), item)
            comm += [CommOp("p2p", CP, "backward", acc, name, accumulator=True)
                     for _ in range(c)]
    return comm
