"""Sequence-parallel attention over one mesh axis ("cp"): ring attention and Ulysses.

Ring attention (Li et al. 2021, arXiv 2105.13120) keeps each rank's query block and passes
key/value blocks round the ring, folding each in with the online softmax (as FlashAttention,
Dao et al. 2022). Ulysses (Jacobs et al. 2023, arXiv 2309.14509) trades the sequence split
for a head split with an all-to-all, runs whole-sequence attention, and trades back. Tensors
are [B, H, S_local, D] as torch's SDPA; the sequence lies "contiguous" or "zigzag" over the
axis. Every member must call the same kernels with the same `requires_grad` flags. Layouts,
algorithms and the bytes each kernel logs: README.md beside this file.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from autopar.kernels.collectives import AxisGroup, Bound
from autopar.modes import CONTIGUOUS, CP, RING, ULYSSES, ZIGZAG

__all__ = [
    "LAYOUTS", "MODES", "TILE", "sequence_chunks", "sequence_positions", "cut_sequence",
    "merge_sequence", "assemble_sequence", "all_to_all", "ring_attention",
    "ulysses_attention", "ulysses_kv_replication", "sequence_attention", "SequenceAttention",
]

LAYOUTS = (CONTIGUOUS, ZIGZAG)
MODES = (RING, ULYSSES)
SEQ_DIM = 2  # [B, H, S, D]
# Rows per tile (query rows and key rows) of the ring kernel's block pairs: a tile's scores
# are B*H*TILE*TILE elements (1 MiB per head in float32), whatever S_local is. 512 is the
# key split of torch's CPU flash attention and big enough for efficient matmuls.
TILE = 512


# --------------------------------------------------------------------------------------
# Layouts of the sequence over the axis
# --------------------------------------------------------------------------------------


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; expected one of {LAYOUTS}")


def _num_chunks(size: int, layout: str) -> int:
    _check_layout(layout)
    return size if layout == CONTIGUOUS else 2 * size


def sequence_chunks(size: int, rank: int, layout: str = CONTIGUOUS) -> tuple[int, ...]:
    """The chunks of the global sequence member `rank` of `size` holds, in local order:
    contiguous (rank,) of `size` chunks; zigzag (rank, 2*size-1-rank) of 2*size chunks."""
    _check_layout(layout)
    if layout == CONTIGUOUS:
        return (rank,)
    return (rank, 2 * size - 1 - rank)


def _chunk_len(seq_len: int, size: int, layout: str) -> int:
    n = _num_chunks(size, layout)
    if seq_len % n:
        raise ValueError(f"a sequence of {seq_len} does not split into the {n} equal chunks "
                         f"of the {layout} layout over {size} members")
    return seq_len // n


def sequence_positions(seq_len: int, size: int, rank: int,
                       layout: str = CONTIGUOUS) -> torch.Tensor:
    """Global positions (int64) of the rows member `rank` holds of a sequence of `seq_len`."""
    m = _chunk_len(seq_len, size, layout)
    return torch.cat([torch.arange(c * m, (c + 1) * m)
                      for c in sequence_chunks(size, rank, layout)])


def cut_sequence(full: torch.Tensor, group: AxisGroup, dim: int = SEQ_DIM,
                 layout: str = CONTIGUOUS) -> torch.Tensor:
    """This member's block (a copy) of the whole tensor `full`, split on `dim` over `group`."""
    pos = sequence_positions(full.shape[dim], group.size, group.rank, layout)
    return full.index_select(dim, pos.to(full.device))


def _rank_major_index(seq_len: int, size: int, layout: str) -> torch.Tensor:
    """Global position of each row of the members' blocks concatenated in member order."""
    return torch.cat([sequence_positions(seq_len, size, r, layout) for r in range(size)])


def _to_natural(x: torch.Tensor, size: int, dim: int, layout: str) -> torch.Tensor:
    """Member-order concatenation of blocks -> the sequence in natural order."""
    if layout == CONTIGUOUS or size == 1:
        return x
    order = _rank_major_index(x.shape[dim], size, layout)
    return x.index_select(dim, torch.argsort(order).to(x.device))


def _from_natural(x: torch.Tensor, size: int, dim: int, layout: str) -> torch.Tensor:
    """The sequence in natural order -> the members' blocks concatenated in member order."""
    if layout == CONTIGUOUS or size == 1:
        return x
    return x.index_select(dim, _rank_major_index(x.shape[dim], size, layout).to(x.device))


def merge_sequence(blocks: Sequence[torch.Tensor], dim: int = SEQ_DIM,
                   layout: str = CONTIGUOUS) -> torch.Tensor:
    """The whole tensor from the blocks of members 0..len(blocks)-1 (inverse of
    `cut_sequence`); no communication."""
    return _to_natural(torch.cat(list(blocks), dim), len(blocks), dim, layout)


def assemble_sequence(block: torch.Tensor, group: AxisGroup, dim: int = SEQ_DIM,
                      layout: str = CONTIGUOUS, phase: str = "state") -> torch.Tensor:
    """The whole tensor from every member's `block` (a collective: all members call):
    an all-gather over `group`, then the chunks put in natural order."""
    gathered = group.all_gather(block.detach(), dim, 1, phase)
    return _to_natural(gathered, group.size, dim % block.dim(), layout)


# --------------------------------------------------------------------------------------
# Ring attention
# --------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _pack(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([a.reshape(-1), b.reshape(-1)])


def _unpack(flat: torch.Tensor, shape_a, shape_b) -> tuple[torch.Tensor, torch.Tensor]:
    n = math.prod(shape_a)
    return flat[:n].view(shape_a), flat[n:].view(shape_b)


def _pairs(size: int, rank: int, src: int, layout: str, causal: bool, s_q: int, s_k: int):
    """(query rows, key rows, diagonal?) of the blocks member `rank` computes against the
    k/v block of member `src`: everything without causal masking; under it the pairs of
    chunks with key chunk <= query chunk, the equal ones masked by a triangle."""
    if not causal:
        return [(slice(None), slice(None), False)]
    qc, kc = sequence_chunks(size, rank, layout), sequence_chunks(size, src, layout)
    mq, mk = s_q // len(qc), s_k // len(kc)
    return [(slice(i * mq, (i + 1) * mq), slice(j * mk, (j + 1) * mk), b == a)
            for i, a in enumerate(qc) for j, b in enumerate(kc) if b <= a]


def _tiles(qs: slice, ks: slice, diag: bool, s_q: int, s_k: int, tile: int):
    """(query rows, key rows, mask offset or None) of the tiles of one block pair: the pair's
    query rows and key rows cut into `tile`-row pieces from the start of each chunk (the last
    one ragged). Under a diagonal pair the tiles wholly above the diagonal are skipped and
    those straddling it carry the offset i0 - j0 of their first query row from their first
    key row (the mask is triu(offset + 1)); as the query and key chunks have the same length
    and are cut at the same points, every query row of a tile kept sees at least one key of
    it (its first key is at or before the tile's first query)."""
    q0, q1, _ = qs.indices(s_q)
    k0, k1, _ = ks.indices(s_k)
    for i0 in range(q0, q1, tile):
        i1 = min(i0 + tile, q1)
        for j0 in range(k0, k1, tile):
            j1 = min(j0 + tile, k1)
            if diag:
                a, b = i0 - q0, j0 - k0  # offsets within the (equal-length) chunks
                if b >= a + (i1 - i0):
                    break  # this tile and the later ones are wholly above the diagonal
                off = a - b if j1 - k0 - 1 > a else None  # a key past the first query row
            else:
                off = None
            yield slice(i0, i1), slice(j0, j1), off


def _scores(q5, kt, qs, ks, off, scale: float) -> torch.Tensor:
    """Scores of one tile, [B, Hkv, rep, rows, cols]; -inf where key > query (off set)."""
    s = torch.matmul(q5[..., qs, :], kt[..., ks, :].transpose(-1, -2)) * scale
    if off is not None:
        upper = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(off + 1)
        s = s.masked_fill(upper, float("-inf"))
    return s


def _ring_forward(q, k, v, g: AxisGroup, causal: bool, scale: float, layout: str,
                  tile: int):
    b, h, s_q, _ = q.shape
    hkv, s_k, dv = k.shape[1], k.shape[2], v.shape[-1]
    cdt = _compute_dtype(q.dtype)
    q5 = q.to(cdt).unflatten(1, (hkv, h // hkv))  # [B, Hkv, rep, S_local, D]
    m = q5.new_full(q5.shape[:-1], float("-inf"))
    l = q5.new_zeros(q5.shape[:-1])
    acc = q5.new_zeros(q5.shape[:-1] + (dv,))
    kv = _pack(k, v)
    for t in range(g.size):
        src = (g.rank - t) % g.size
        nxt = g.shift_async(kv, 1, "forward") if t < g.size - 1 else None
        kt, vt = (x.to(cdt).unsqueeze(2) for x in _unpack(kv, k.shape, v.shape))
        for qs, ks, diag in _pairs(g.size, g.rank, src, layout, causal, s_q, s_k):
            for rows, cols, off in _tiles(qs, ks, diag, s_q, s_k, tile):
                s = _scores(q5, kt, rows, cols, off, scale)
                m_t, l_t, acc_t = m[..., rows], l[..., rows], acc[..., rows, :]  # views
                m_new = torch.maximum(m_t, s.amax(-1))  # finite: every row sees a key
                alpha = torch.exp(m_t - m_new)
                p = torch.exp(s.sub_(m_new.unsqueeze(-1)))
                del s
                l_t.mul_(alpha).add_(p.sum(-1))
                acc_t.mul_(alpha.unsqueeze(-1)).add_(torch.matmul(p, vt[..., cols, :]))
                m_t.copy_(m_new)
        if nxt is not None:
            kv = nxt.wait()
    out = (acc / l.unsqueeze(-1)).flatten(1, 2).to(q.dtype)
    lse = m + torch.log(l)  # [B, Hkv, rep, S_local]
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, g: AxisGroup, causal: bool, scale: float,
                   layout: str, want_dkv: bool, tile: int):
    s_q, hkv, s_k = q.shape[2], k.shape[1], k.shape[2]
    cdt = lse.dtype
    q5 = q.to(cdt).unflatten(1, (hkv, q.shape[1] // hkv))
    do5 = dout.to(cdt).unflatten(1, (hkv, q.shape[1] // hkv))
    delta = (do5 * out.to(cdt).unflatten(1, (hkv, q.shape[1] // hkv))).sum(-1)
    dq = torch.zeros_like(q5)
    kv = _pack(k, v)
    arriving, dkv = None, None  # the dk/dv accumulator in flight; the final one
    for t in range(g.size):
        src = (g.rank - t) % g.size
        nxt = g.shift_async(kv, 1, "backward", tag=0) if t < g.size - 1 else None
        kt, vt = (x.to(cdt).unsqueeze(2) for x in _unpack(kv, k.shape, v.shape))
        dk_t = q5.new_zeros(k.shape) if want_dkv else None
        dv_t = q5.new_zeros(v.shape) if want_dkv else None
        for qs, ks, diag in _pairs(g.size, g.rank, src, layout, causal, s_q, s_k):
            for rows, cols, off in _tiles(qs, ks, diag, s_q, s_k, tile):
                s = _scores(q5, kt, rows, cols, off, scale)
                p = torch.exp(s.sub_(lse[..., rows].unsqueeze(-1)))
                del s
                ds = torch.matmul(do5[..., rows, :], vt[..., cols, :].transpose(-1, -2))
                ds.sub_(delta[..., rows].unsqueeze(-1)).mul_(p)  # dS = P * (dP - delta)
                dq[..., rows, :] += torch.matmul(ds, kt[..., cols, :]) * scale
                if want_dkv:
                    pdo = torch.matmul(p.transpose(-1, -2), do5[..., rows, :])
                    del p
                    dv_t[..., cols, :] += pdo.sum(2)
                    dsq = torch.matmul(ds.transpose(-1, -2), q5[..., rows, :])
                    dk_t[..., cols, :] += dsq.sum(2) * scale
        if want_dkv:
            part = _pack(dk_t, dv_t)
            if arriving is not None:
                part = part + arriving.wait()
            if g.size > 1:
                arriving = g.shift_async(part, 1, "backward", tag=1)
            else:
                dkv = part
        if nxt is not None:
            kv = nxt.wait()
    dk = dv = None
    if want_dkv:
        if arriving is not None:
            dkv = arriving.wait()  # the accumulator of this member's own block, home again
        dk, dv = (x.to(k.dtype) for x in _unpack(dkv, k.shape, v.shape))
    return dq.flatten(1, 2).to(q.dtype), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g: AxisGroup, causal: bool, scale: float, layout: str,
                tile: int):
        out, lse = _ring_forward(q, k, v, g, causal, scale, layout, tile)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.g, ctx.causal, ctx.scale, ctx.layout, ctx.tile = g, causal, scale, layout, tile
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        need = ctx.needs_input_grad
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.g, ctx.causal, ctx.scale,
                                    ctx.layout, need[1] or need[2], ctx.tile)
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                None, None, None, None, None)


def _check_qkv(q, k, v, what: str) -> tuple[int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{what} takes q, k, v as [B, H, S_local, D]; got shapes "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{what}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    h, hkv = q.shape[1], k.shape[1]
    if (k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]
            or h % hkv):
        raise ValueError(f"{what}: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} "
                         "do not fit [B, H, S, D], [B, Hkv, S', D], [B, Hkv, S', Dv] with "
                         "H a multiple of Hkv")
    return h, hkv


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup, *,
                   causal: bool = False, scale: float | None = None,
                   layout: str = CONTIGUOUS, tile: int | None = None) -> torch.Tensor:
    """Attention of the whole sequence split over `group` by ring attention.

    q [B, H, S_local, D], k [B, Hkv, S_local, D], v [B, Hkv, S_local, Dv], all in `layout`
    (README.md beside this file); returns this member's rows of the output,
    [B, H, S_local, Dv]. Equals `scaled_dot_product_attention(..., is_causal=causal,
    scale=scale, enable_gqa=True)` on the whole sequence, cut the same way. Each block pair
    is computed in tiles of `tile` query rows x `tile` key rows (default `TILE`).
    """
    _check_qkv(q, k, v, "ring_attention")
    _check_layout(layout)
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError("causal ring attention needs as many local queries as keys; got "
                         f"{q.shape[2]} and {k.shape[2]}")
    if layout == ZIGZAG and causal and q.shape[2] % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per member; S_local = "
                         f"{q.shape[2]} is odd")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    tile = TILE if tile is None else int(tile)
    if tile < 1:
        raise ValueError(f"ring attention tiles need at least one row; got tile={tile}")
    return _RingAttention.apply(q, k, v, group, causal, float(scale), layout, tile)


# --------------------------------------------------------------------------------------
# Ulysses
# --------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: AxisGroup, scatter_dim: int, gather_dim: int):
        ctx.g, ctx.dims = g, (scatter_dim, gather_dim)
        return g.all_to_all(x, scatter_dim, gather_dim, "forward")

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return ctx.g.all_to_all(grad, gather_dim, scatter_dim, "backward"), None, None, None


def all_to_all(x: torch.Tensor, group: AxisGroup, scatter_dim: int,
               gather_dim: int) -> torch.Tensor:
    """`AxisGroup.all_to_all` with autograd: the gradient takes the inverse exchange."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def ulysses_kv_replication(kv_heads: int, size: int) -> int:
    """How many times Ulysses repeats each kv head: size / gcd(kv_heads, size)."""
    return size // math.gcd(kv_heads, size)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup, *,
                      causal: bool = False, scale: float | None = None,
                      layout: str = CONTIGUOUS) -> torch.Tensor:
    """Attention of the whole sequence split over `group` by Ulysses all-to-alls.

    Same layouts, arguments and result as `ring_attention`; needs H % group.size == 0.
    """
    h, hkv = _check_qkv(q, k, v, "ulysses_attention")
    _check_layout(layout)
    c = group.size
    if h % c:
        raise ValueError(f"Ulysses splits the {h} query heads over the {c} members of axis "
                         f"'{group.axis}'; {h} is not a multiple of {c}")
    f = ulysses_kv_replication(hkv, c)
    if f > 1:
        k, v = k.repeat_interleave(f, dim=1), v.repeat_interleave(f, dim=1)
    qg, kg, vg = (all_to_all(x, group, 1, SEQ_DIM) for x in (q, k, v))  # [B, heads/c, S, .]
    reorder = causal and layout == ZIGZAG
    if reorder:
        qg, kg, vg = (_to_natural(x, c, SEQ_DIM, layout) for x in (qg, kg, vg))
    o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale,
                                       enable_gqa=kg.shape[1] != qg.shape[1])
    if reorder:
        o = _from_natural(o, c, SEQ_DIM, layout)
    return all_to_all(o, group, SEQ_DIM, 1)


# --------------------------------------------------------------------------------------
# Entry point mirroring scaled_dot_product_attention, and the graph module
# --------------------------------------------------------------------------------------


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup,
                       mode: str = RING, *, attn_mask=None, dropout_p: float = 0.0,
                       is_causal: bool = False, scale: float | None = None,
                       enable_gqa: bool = False, layout: str = CONTIGUOUS) -> torch.Tensor:
    """`scaled_dot_product_attention`'s arguments on sequence-split q, k, v, by `mode`
    ("ring" or "ulysses"). `attn_mask` and dropout are not supported. As in torch, k and v
    with one head broadcast over every query head (multi-query attention) without
    `enable_gqa`; other head counts that differ from q's need it."""
    if mode not in MODES:
        raise ValueError(f"unknown sequence-parallel mode {mode!r}; expected one of {MODES}")
    if attn_mask is not None:
        raise ValueError("sequence-parallel attention takes no attn_mask, only is_causal; "
                         "attention with a mask runs on the gathered sequence (the graph "
                         "pass gathers it)")
    if dropout_p:
        raise ValueError("sequence-parallel attention has no dropout; attention with "
                         "dropout runs on the gathered sequence (the graph pass gathers it)")
    if q.shape[1] != k.shape[1] != 1 and not enable_gqa:  # one kv head broadcasts (MQA)
        raise ValueError(f"q has {q.shape[1]} heads and k {k.shape[1]}; pass enable_gqa=True "
                         "for grouped-query attention")
    kernel = ring_attention if mode == RING else ulysses_attention
    return kernel(q, k, v, group, causal=is_causal, scale=scale, layout=layout)


class SequenceAttention(Bound):
    """A graph module for an attention core whose q, k, v are split on the sequence dim over
    the mesh axis `axis` (bound to an `AxisGroup` before the graph runs)."""

    def __init__(self, axis: str = CP, mode: str = RING, is_causal: bool = False,
                 scale: float | None = None, enable_gqa: bool = False,
                 layout: str = CONTIGUOUS):
        super().__init__(axis)
        if mode not in MODES:
            raise ValueError(f"unknown sequence-parallel mode {mode!r}; expected one of {MODES}")
        _check_layout(layout)
        self.mode, self.is_causal, self.scale = mode, is_causal, scale
        self.enable_gqa, self.layout = enable_gqa, layout

    def extra_repr(self) -> str:
        return (f"{self.mode}, axis={self.axis}, is_causal={self.is_causal}, "
                f"layout={self.layout}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sequence_attention(q, k, v, self._g(), self.mode, is_causal=self.is_causal,
                                  scale=self.scale, enable_gqa=self.enable_gqa,
                                  layout=self.layout)
